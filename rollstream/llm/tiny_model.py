"""A tiny Qwen2-architecture causal LM and a locally trained byte-level BPE tokenizer, built
with no download, so the built-in server, the agent loop and the trainer run (and are
tested) on a CPU through the same `from_pretrained` code path as a real Qwen3 checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Qwen marks the tool and think tags as added but *not* special, so that decoding with
# skip_special_tokens=True keeps them in the text the agent loop parses.
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]
ADDED_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

_MARKER = "rollstream_tiny_model.json"
# Qwen2's split pattern: contractions, letter runs, single digits, punctuation runs, newlines.
_QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Bump when the recipe changes so that cached folders are rebuilt.
_RECIPE_VERSION = 2

# A Qwen2.5/Qwen3-style chat template (Hermes tool calls). Tools are rendered as JSON
# schemas in the system turn, assistant tool calls as <tool_call>{json}</tool_call>, and a
# run of role "tool" messages as <tool_response> blocks inside one user turn.
CHAT_TEMPLATE = r"""
{%- macro render_content(content) -%}
{%- if content is string -%}{{- content -}}
{%- elif content is none -%}
{%- else -%}{%- for part in content -%}{%- if part.text is defined -%}{{- part.text -}}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- render_content(messages[0].content) + '\n\n' -}}{%- endif -%}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'tool' -%}
{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + render_content(message.content) -}}
{%- if message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- if tool_call.function is defined -%}{%- set call = tool_call.function -%}{%- else -%}{%- set call = tool_call -%}{%- endif -%}
{%- if (loop.first and message.content) or not loop.first -%}{{- '\n' -}}{%- endif -%}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
{%- if call.arguments is string -%}{{- call.arguments -}}{%- else -%}{{- call.arguments | tojson -}}{%- endif -%}
{{- '}\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
""".strip()

# The tokenizer's training text: English, code, JSON, digits and chat-formatted turns, so
# that every kind of text the agent loop renders gets short, realistic token sequences.
_CORPUS_BASE = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.",
    "You are a helpful assistant. Solve the task, then call the submit tool with your answer.",
    "Please write a function that returns the sum of two numbers and test it.",
    "The file was created successfully. The command exited with status 0.",
    "Error: file not found. Traceback (most recent call last): ValueError: invalid literal for int()",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "import os\nimport sys\n\nfor i in range(10):\n    if i % 2 == 0:\n        print(i, file=sys.stderr)\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    "$ ls -la /tmp && cat README.md | grep -n 'install' ; echo $?\n",
    "cd /workspace && python -m pytest -x -q tests/ 2>&1 | tail -n 20\n",
    '{"name": "bash", "arguments": {"command": "ls -la"}}',
    '{"name": "ipython", "arguments": {"code": "print(1 + 1)"}}',
    '{"name": "editor", "arguments": {"command": "create", "path": "/tmp/a.py", "file_text": "x = 1\\n"}}',
    '{"name": "submit", "arguments": {"answer": "42"}}',
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command", '
    '"parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}',
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 42 64 100 128 256 512 1000 1024 2048 3.14159 -7 1e-4",
    "What is 12 + 30? The answer is 42. What is 7 * 6? Also 42. 2 ** 10 = 1024.",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n"
    "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n",
    "<|im_start|>assistant\n<tool_call>\n{\"name\": \"bash\", \"arguments\": {\"command\": \"pwd\"}}\n</tool_call><|im_end|>\n"
    "<|im_start|>user\n<tool_response>\n/workspace\n</tool_response><|im_end|>\n",
    "<think>\nLet me think step by step about the problem.\n</think>\n\nThe result is correct.",
]


_WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which "
    "but all were when we there can more if no out so what up said about other into than its time "
    "only could new them these some would first then two like been may each make most over did "
    "number people water call who oil now find long down day get come made part file files path "
    "directory command output error errors test tests passed failed function functions return value "
    "values string strings integer list dict class method module import package install python bash "
    "shell script run running result results answer question problem solution step steps check "
    "checking write read open close create delete update insert replace view line lines code text "
    "task tasks tool tools call calls submit finish user assistant system message messages response "
    "request server model token tokens batch cache memory process thread worker job queue stream "
    "because however therefore first second third next last before after while until always never "
    "please thanks sorry okay sure great good better best simple small large fast slow correct wrong"
).split()


def _corpus() -> list[str]:
    # Repetition (with small variations) gives BPE enough pair counts to learn merges.
    lines: list[str] = []
    n = len(_WORDS)
    for i in range(400):
        # A deterministic pseudo-random walk over the word list makes varied sentences.
        words = [_WORDS[(i * 7 + j * j * 13 + j) % n] for j in range(12)]
        lines.append(" ".join(words).capitalize() + ".")
        lines.append(" ".join(w.capitalize() for w in words[:4]) + "_" + "_".join(words[4:7]) + "()")
    for i in range(40):
        for text in _CORPUS_BASE:
            lines.append(text)
        lines.append(f"step {i}: value = {i * 37 % 101}, total = {i * i}, ok = {str(i % 3 == 0).lower()}")
        lines.append(json.dumps({"id": i, "score": i / 7, "tags": ["a", "b"], "done": i % 2 == 0}))
    return lines


def _recipe(seed: int, vocab_size: int, hidden_size: int, num_layers: int) -> dict:
    return {
        "recipe_version": _RECIPE_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
    }


def _train_tokenizer(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # The same normalizer and pre-tokenizer as transformers' Qwen2Tokenizer, which
    # AutoTokenizer picks for model_type "qwen2": the folder then tokenizes identically
    # whichever class loads it.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + ADDED_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        model_max_length=4096,
    )
    # Re-register the tool/think tags as non-special added tokens (ids already exist).
    from tokenizers import AddedToken

    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_model(vocab_size: int, hidden_size: int, num_layers: int, seed: int, tokenizer):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        # A wider init than usual makes next-token distributions peaked, so greedy
        # decoding has no near-ties that padding-dependent float noise could flip.
        initializer_range=0.2,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def build_tiny_model(
    out_dir: Path | str,
    seed: int = 0,
    vocab_size: int = 1536,
    hidden_size: int = 128,
    num_layers: int = 4,
) -> Path:
    """Build (or reuse, if already built with the same recipe) a ~1M-parameter Qwen2 causal
    LM with a chat-template tokenizer in `out_dir`; returns the folder, loadable with
    AutoModelForCausalLM / AutoTokenizer.from_pretrained."""
    out = Path(out_dir)
    recipe = _recipe(seed, vocab_size, hidden_size, num_layers)
    marker = out / _MARKER
    if marker.exists():
        try:
            if json.loads(marker.read_text()) == recipe:
                return out
        except (OSError, json.JSONDecodeError):
            pass
        raise FileExistsError(
            f"{out} holds a tiny model built with another recipe; delete the folder or pass "
            f"another out_dir (wanted {recipe})"
        )
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not a tiny-model folder; pass an empty or new folder")

    tokenizer = _train_tokenizer(vocab_size)
    # The trained vocabulary can come out short of the request when the corpus runs out of
    # merges; size the embeddings to the real vocabulary so that every id the model can
    # sample decodes to text.
    model_vocab = len(tokenizer)
    model = _build_model(model_vocab, hidden_size, num_layers, seed, tokenizer)

    # Build in a sibling temp folder and rename, so concurrent builders (pytest-xdist,
    # several servers) never see a half-written model.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / _MARKER).write_text(json.dumps(recipe))
        if out.exists():
            out.rmdir()
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process won the race; its folder has the same recipe.
            if not (out / _MARKER).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("built tiny model in %s (%d params, vocab %d)", out, n_params, model_vocab)
    return out


def recipe_digest(model_dir: Path | str) -> str:
    """Short hash of a tiny model's recipe, for cache keys and logs."""
    return hashlib.sha1((Path(model_dir) / _MARKER).read_bytes()).hexdigest()[:12]
