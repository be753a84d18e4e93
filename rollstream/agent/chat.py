"""Token bookkeeping through the model's chat template: the prompt is tokenized once, and
each tool observation becomes exactly the tokens the template adds for it, computed as the
difference of two renderings, so the model's own tokens are never re-tokenized.

A job's ``chat_template_kwargs`` are variables of the model's template. A template of the job's
own (``chat_template``) runs only where the operator allows it (``agent_job_chat_templates``),
in jinja's immutable sandbox (transformers' renderer), each rendering bounded in time and memory.
"""

from __future__ import annotations

import functools
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from rollstream.config import load_settings
from rollstream.errors import InvalidJob


def _jinja_functions() -> tuple[Callable[..., Any], Callable[[str], Any]] | None:
    """What apply_chat_template renders with once it has found the template (transformers >= 4.49):
    its renderer, and its compiler (its jinja sandbox, its globals); None for an older transformers,
    where every rendering goes through apply_chat_template.
    Imported where a tokenizer is in hand (transformers is loaded then): at the top of this module
    it loaded transformers into every worker and CLI process, seconds of CPU each."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template
    except ImportError:
        return None
    return render_jinja_template, _compile_jinja_template


# Attribute checks remembered per compiled template; past this many (type, attribute) pairs (a
# template that makes names up with the attr filter) the rest are checked every time.
MAX_REMEMBERED_CHECKS = 1024


def _remember_attribute_checks(environment: Any) -> None:
    """Make ``environment`` (jinja's immutable sandbox, as transformers compiles a chat template in)
    remember its verdict on each attribute a template reads, by the object's type and the name.
    Its check is a function of those two alone (a leading underscore, the internal attributes of
    functions, methods, types, code, frames and generators, the methods that modify a list, dict
    or set: all decided by name and by type), so the verdict is the same, reached once: a Qwen
    template asks for ``loop.first``, ``loop.last``, ``loop.previtem``, ``loop.nextitem`` once per
    message, and those checks were a fifth of a rendering. Any other environment is left as it is."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if type(environment) is not ImmutableSandboxedEnvironment:
        return
    check = environment.is_safe_attribute
    verdicts: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = verdicts.get(key)
        if safe is None:
            safe = check(obj, attr, value)
            if len(verdicts) < MAX_REMEMBERED_CHECKS:
                verdicts[key] = safe
        return safe

    environment.is_safe_attribute = is_safe_attribute  # type: ignore[method-assign]  # this one instance's, on purpose


@functools.lru_cache(maxsize=64)
def _compiled_template(template: str) -> Any:
    """transformers' compilation of ``template`` in an environment of its own (transformers caches
    one per template for every apply_chat_template call; this one is rollstream's), whose attribute
    checks are remembered (_remember_attribute_checks). None where transformers has no compiler."""
    jinja = _jinja_functions()
    if jinja is None:
        return None
    compile_template = jinja[1]
    compiled = getattr(compile_template, "__wrapped__", None)
    if compiled is None:  # not behind its cache: its environment is transformers' own, left as it is
        return compile_template(template)
    compiled = compiled(template)
    _remember_attribute_checks(compiled.environment)
    return compiled


_JSON_SCALARS = (str, int, float, bool, type(None))
# Message fields transformers copies under other names before rendering (its _REASONING_FIELDS).
_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})


def _plain(value: Any) -> bool:
    """Whether ``value`` is made of JSON's own types only: what transformers' conversion of the
    template's data (which turns any other object into plain data, for the sandbox) copies unchanged."""
    kind = type(value)
    if kind in _JSON_SCALARS:
        return True
    if kind is dict:
        return all(type(key) is str and _plain(item) for key, item in value.items())
    if kind is list:
        return all(_plain(item) for item in value)
    return False


T = TypeVar("T")
JOB_TEMPLATE = "chat_template"
# apply_chat_template's own parameters: from a job they would pick another template or change
# what the call returns, so no job sets them through chat_template_kwargs.
CALL_PARAMETERS = frozenset({"conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
                             "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
                             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
ALLOW_SETTING = "agent_job_chat_templates (ROLLSTREAM_AGENT_JOB_CHAT_TEMPLATES)"
# What one rendering of a job's own template may add to the worker's peak memory.
JOB_TEMPLATE_MAX_GROWTH_BYTES = 256 * 2**20


class ChatTemplateError(ValueError):
    """The tokenizer's chat template cannot be used for token-exact multi-turn rollouts."""


class ChatTemplateRefused(InvalidJob):
    """A job's chat_template_kwargs ask for what this node does not run: the template's call
    parameters, or a template of the job's own where the operator does not allow one."""


class ChatTemplateTooCostly(InvalidJob):
    """A job's own chat template ran past its time or memory bound while rendering."""


def job_template(kwargs: dict, allowed: bool | None = None) -> bool:
    """Whether a job's ``chat_template_kwargs`` bring a template of its own; ChatTemplateRefused
    for a call parameter, or for a template where ``allowed`` (default: the operator's
    setting) is false."""
    called = sorted(set(kwargs) & CALL_PARAMETERS)
    if called:
        raise ChatTemplateRefused(f"agent.chat_template_kwargs may not set {', '.join(called)}: those are the "
                                  "renderer's own parameters, not template variables")
    if JOB_TEMPLATE not in kwargs:
        return False
    if not (load_settings().agent_job_chat_templates if allowed is None else allowed):
        raise ChatTemplateRefused(f"agent.chat_template_kwargs.{JOB_TEMPLATE}: this node renders the model's own "
                                  "chat template only; leave chat_template out, or ask the operator to allow a "
                                  f"job's template ({ALLOW_SETTING})")
    if not isinstance(kwargs[JOB_TEMPLATE], str) or "{" not in kwargs[JOB_TEMPLATE]:
        raise ChatTemplateRefused(f"agent.chat_template_kwargs.{JOB_TEMPLATE} must be a Jinja template's text")
    return True


def bounded(render: Callable[[], T], limit_s: float, max_growth_bytes: int = JOB_TEMPLATE_MAX_GROWTH_BYTES) -> T:
    """``render()`` stopped with ChatTemplateTooCostly once it runs past ``limit_s`` or grows the
    process's peak memory by more than ``max_growth_bytes``: checked at every Python line it
    runs (jinja compiles a template to Python, so a loop that never outputs is checked too)."""
    until = time.monotonic() + limit_s
    peak_limit_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + max_growth_bytes // 1024

    def check(frame: Any, event: str, arg: Any) -> Callable:
        if time.monotonic() > until:
            raise ChatTemplateTooCostly(f"the job's chat template ran past {limit_s:g} s; it renders each turn, "
                                        "so it must be a template, not a computation")
        if resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > peak_limit_kib:
            raise ChatTemplateTooCostly(f"the job's chat template grew memory by more than "
                                        f"{max_growth_bytes // 2**20} MiB while rendering")
        return check

    previous = sys.gettrace()
    sys.settrace(check)
    try:
        return render()
    finally:
        sys.settrace(previous)


class ChatRenderer:
    """Renders messages with a Hugging Face tokenizer's chat template (tools included)."""

    def __init__(
        self,
        tokenizer: Any,
        tools: list[dict] | None = None,
        end_of_turn_token: str | None = None,
        template_kwargs: dict | None = None,
        job_templates_allowed: bool | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        # A template of the job's own: None, else the time bound of one rendering.
        self.job_template_s: float | None = None
        if job_template(self.template_kwargs, job_templates_allowed):
            self.job_template_s = load_settings().agent_job_chat_template_timeout_s
        self.end_of_turn = end_of_turn_token or tokenizer.eos_token
        if not self.end_of_turn:
            raise ChatTemplateError(
                "the tokenizer has no eos token; set AgentSettings.end_of_turn_token (e.g. '<|im_end|>')"
            )
        eot_id = tokenizer.convert_tokens_to_ids(self.end_of_turn)
        if not isinstance(eot_id, int) or eot_id == getattr(tokenizer, "unk_token_id", None):
            raise ChatTemplateError(f"end-of-turn token {self.end_of_turn!r} is not one token of this tokenizer")
        self.end_of_turn_id: int = eot_id
        # apply_chat_template finds the template and gathers the special tokens on every call
        # (a sixth of a short rendering's time, and the door renders twice per model call): they
        # are found once here, and each rendering is the same jinja call it makes with them.
        self._template: str | None = None
        self._variables: dict[str, Any] = {}
        self._render_jinja: Callable[..., Any] | None = None
        self._compiled: Any = None  # for data of JSON's own types, rendered without copying it first
        jinja = _jinja_functions()
        if jinja is not None and hasattr(tokenizer, "get_chat_template"):
            self._render_jinja = jinja[0]
            variables = dict(self.template_kwargs)
            self._template = tokenizer.get_chat_template(variables.pop(JOB_TEMPLATE, None), self.tools)
            self._variables = {**tokenizer.special_tokens_map, **variables}
            if _plain(self.tools) and _plain(self._variables):
                self._compiled = _compiled_template(self._template)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        def apply() -> Any:
            if (self._template is None or self._render_jinja is None or not messages
                    or not all(type(m) is dict for m in messages)):
                return self.tokenizer.apply_chat_template(
                    messages,
                    tools=self.tools,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=False,
                    **self.template_kwargs,
                )
            # As apply_chat_template passes them: without the keys whose value is None.
            conversation = [{k: v for k, v in m.items() if v is not None} for m in messages]
            if self._compiled is not None and all(_REASONING_FIELDS.isdisjoint(m) and _plain(m) for m in conversation):
                # render_jinja_template's own call: the copy it would make of this data (JSON's types
                # only, as a harness's request and a tool list are) is the data itself, and copying
                # a coding CLI's tool list (tens of KiB) twice per model call is most of a rendering.
                return self._compiled.render(messages=conversation, tools=self.tools, documents=None,
                                             add_generation_prompt=add_generation_prompt, **self._variables)
            rendered, _ = self._render_jinja(
                conversations=[conversation],
                tools=self.tools,
                chat_template=self._template,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
            return rendered[0]

        if self.job_template_s is None:
            text = apply()
        else:
            try:
                text = bounded(apply, self.job_template_s)
            except InvalidJob:
                raise
            except Exception as exc:  # whatever the job's template does wrong (jinja's SecurityError too) is its own
                raise ChatTemplateRefused(f"the job's chat template does not render: {type(exc).__name__}: "
                                          f"{str(exc)[:500]}") from exc
        if not isinstance(text, str):
            raise ChatTemplateError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
        return text

    def encode(self, text: str) -> list[int]:
        # The template already wrote every special token; the tokenizer must add none.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The episode's prompt, tokenized once, ending with the assistant generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def observation_ids(self, history: list[dict], new_messages: list[dict], model_ended_turn: bool,
                        before: str | None = None) -> list[int]:
        """Tokens that follow the model's last generated token so that the context reads like
        render(history + new_messages, add_generation_prompt=True).

        `history` ends with the assistant message of the last turn. The delta is whatever
        the template writes after that assistant turn's end token (e.g. the newline after
        <|im_end|>), plus the end token itself when the model did not produce it (cut at
        max_tokens), plus the new messages and the next generation prompt. ``before``, when
        given, is ``render(history, add_generation_prompt=False)`` computed earlier."""
        if before is None:
            before = self.render(history, add_generation_prompt=False)
        after = self.render(history + new_messages, add_generation_prompt=True)
        if not after.startswith(before):
            raise ChatTemplateError(
                "the chat template renders the history differently once tool messages follow it; "
                "token-exact rollouts need a prefix-stable template (Qwen2.5/Qwen3/Hermes templates are)"
            )
        end = before.rfind(self.end_of_turn)
        if end < 0:
            raise ChatTemplateError(
                f"the rendered assistant turn has no end-of-turn token {self.end_of_turn!r}; "
                "set AgentSettings.end_of_turn_token to the token the template closes turns with"
            )
        # What the template writes after the assistant content that the model did not write.
        template_tail = before[end + len(self.end_of_turn) :] if model_ended_turn else before[end:]
        return self.encode(template_tail + after[len(before) :])
