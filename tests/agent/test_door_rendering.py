"""The chat template's renderings that the door (and the agent loop) tokenize are transformers'
own: ChatRenderer finds the template and the special tokens once, then makes the jinja call that
apply_chat_template makes, so every text it renders must be the one apply_chat_template renders
for the same conversation, tools and template variables (the reference here is transformers)."""

from __future__ import annotations

import pytest

from rollstream.agent.chat import ChatRenderer
from rollstream.tasks import arith

# A template of another shape than the test model's Qwen-style one: the special tokens, a
# variable with a default, tools as JSON, and the generation prompt.
PLAIN = ("{{ bos_token }}{% for m in messages %}<{{ m.role }}{% if m.name is defined %}:{{ m.name }}{% endif %}>"
         "{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
         "{% endfor %}{{ eos_token }}{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
         "{{ note | default('') }}{% if add_generation_prompt %}<assistant>{% endif %}")

CALL = {"type": "function", "function": {"name": "bash", "arguments": {"command": "echo $((2+3))"}}}
CONVERSATIONS = {
    "system and user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
    "tool calls and results": [
        {"role": "system", "content": "You have tools."},
        {"role": "user", "content": "What is 2+3? Use bash."},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "name": "bash", "content": "5\n"},
        {"role": "assistant", "content": "Checking twice.", "tool_calls": [CALL, CALL]},
        {"role": "tool", "content": "5\n"},
        {"role": "tool", "content": "5\n"},
        {"role": "user", "content": "And now?"},
    ],
    # apply_chat_template drops keys whose value is None; the renderer must too.
    "None values": [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "ok", "tool_call_id": None},
    ],
    # Rendered through transformers' own data conversion (reasoning fields it copies under other
    # names; a tuple, which is not JSON's): the same text all the same.
    "reasoning and a tuple": [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "bash", "arguments": {"argv": ("echo", "5")}}}]},
    ],
    "text that looks like markup": [
        {"role": "user", "content": "{{ not a variable }} {% raw %} <|im_end|> ünïcödé \n\t"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nIt is {5}."},
    ],
}


@pytest.fixture(scope="module")
def tokenizer(scripted_model_dir):
    """A tokenizer of its own (its template is changed here), not the session's shared one."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scripted_model_dir)


@pytest.fixture(scope="module")
def model_template(tokenizer) -> str:
    return tokenizer.chat_template


def _reference(tokenizer, messages, tools, add_generation_prompt, **variables) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **variables)


@pytest.mark.parametrize("template", ["model's own", "plain", "one of several"])
@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_renderer_renders_what_apply_chat_template_renders(tokenizer, model_template, template, with_tools,
                                                           conversation):
    # A dict of templates picks "tool_use" when tools are given, else "default": the renderer
    # must pick the one apply_chat_template picks.
    tokenizer.chat_template = {"model's own": model_template, "plain": PLAIN,
                               "one of several": {"default": PLAIN, "tool_use": model_template}}[template]
    tools = [arith.BASH_SCHEMA] if with_tools else None
    messages = CONVERSATIONS[conversation]
    renderer = ChatRenderer(tokenizer, tools, "<|im_end|>", {"note": "(variable)"})
    for add_generation_prompt in (True, False):
        assert renderer.render(messages, add_generation_prompt) == _reference(
            tokenizer, messages, tools, add_generation_prompt, note="(variable)")
    assert renderer.prompt_ids(messages) == tokenizer.encode(
        _reference(tokenizer, messages, tools, True, note="(variable)"), add_special_tokens=False)


def test_a_jobs_own_template_renders_as_apply_chat_template_renders_it(tokenizer, model_template):
    tokenizer.chat_template = model_template
    messages = CONVERSATIONS["tool calls and results"]
    renderer = ChatRenderer(tokenizer, [arith.BASH_SCHEMA], "<|im_end|>", {"chat_template": PLAIN, "note": "!"},
                            job_templates_allowed=True)
    assert renderer.render(messages, True) == _reference(tokenizer, messages, [arith.BASH_SCHEMA], True,
                                                         chat_template=PLAIN, note="!")
    assert renderer.render(messages, True).startswith(tokenizer.bos_token or "")
