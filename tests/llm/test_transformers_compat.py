"""A model call with a key-value cache, as the built-in server and the demo make it, logs no
deprecation warning on the installed transformers (5.x renamed past_key_values to cache): the
demo's terminal stays clean, and the cache still carries the prefix."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from rollstream.llm.transformers_compat import cache_kwargs, output_cache

torch.manual_seed(0)
config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
model = Qwen2ForCausalLM(config).eval()
ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
with torch.no_grad():
    whole = model(input_ids=ids).logits[0, -1]
    cache = output_cache(model(input_ids=ids[:, :4], use_cache=True))
    step = model(input_ids=ids[:, 4:], use_cache=True, **cache_kwargs(model, cache)).logits[0, -1]
print("close" if torch.allclose(whole, step, atol=1e-5) else "differ")
"""


def test_a_cached_model_call_logs_no_deprecation_and_continues_the_prefix():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "close"
    assert "deprecated" not in done.stderr.lower(), done.stderr
