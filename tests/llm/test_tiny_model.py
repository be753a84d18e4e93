"""The tiny local model loads through the same AutoClasses as a Qwen3 checkpoint and its chat
template renders tools, tool calls and tool responses the Hermes/Qwen way."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollstream.llm.tiny_model import ADDED_TOKENS, IM_END, build_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


def test_tiny_model_loads_with_auto_classes(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = sum(p.numel() for p in model.parameters())
    assert 500_000 <= params <= 5_000_000
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    assert 1000 <= len(tok) <= 2000
    assert tok.eos_token == IM_END and tok.pad_token_id is not None
    ids = tok("print(1 + 1)", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == len(tok)


def test_build_is_idempotent_and_refuses_a_foreign_recipe(tiny_model_dir):
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny_model_dir) == tiny_model_dir
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(FileExistsError, match="another recipe"):
        build_tiny_model(tiny_model_dir, seed=7)


def test_same_seed_builds_identical_weights_and_tokenizer(tmp_path, tiny_model_dir):
    other = build_tiny_model(tmp_path / "again")
    assert (other / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()
    assert (other / "model.safetensors").read_bytes() == (tiny_model_dir / "model.safetensors").read_bytes()


def test_text_round_trips_through_the_tokenizer(tokenizer):
    texts = ["def f(x):\n    return x ** 2\n", json.dumps({"a": [1, 2.5, None]}), "naïve café 日本 🙂", "  spaces\t\n"]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_tool_tags_are_single_tokens_kept_when_skipping_special_tokens(tokenizer):
    for tag in ADDED_TOKENS:
        ids = tokenizer.encode(tag)
        assert len(ids) == 1, tag
        assert tokenizer.decode(ids, skip_special_tokens=True) == tag
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.decode([eos], skip_special_tokens=True) == ""


def test_chat_template_renders_tools_calls_and_responses(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls"}}}]},
        {"role": "tool", "content": "a.txt"},
        {"role": "tool", "content": "b.txt"},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n'
            '</tool_call><|im_end|>\n') in text
    # Consecutive tool results share one user turn.
    assert ("<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n<tool_response>\nb.txt\n"
            "</tool_response><|im_end|>\n") in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_accepts_string_arguments_and_plain_chats(tokenizer):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"function": {"name": "bash", "arguments": '{"command": "pwd"}'}}]},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == ('<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nLet me check.\n<tool_call>\n'
                    '{"name": "bash", "arguments": {"command": "pwd"}}\n</tool_call><|im_end|>\n')


def test_chat_template_is_prefix_stable_when_a_turn_is_appended(tokenizer):
    """The agent loop appends only the new tokens of each observation: the rendering of a
    conversation must be a prefix of the rendering with one more message."""
    convo = [{"role": "user", "content": "Run ls."},
             {"role": "assistant", "content": "",
              "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}]},
             {"role": "tool", "content": "x.py"}]
    for k in range(1, len(convo)):
        shorter = tokenizer.apply_chat_template(convo[:k], tools=TOOLS, tokenize=False)
        longer = tokenizer.apply_chat_template(convo[: k + 1], tools=TOOLS, tokenize=False)
        assert longer.startswith(shorter)
