"""Issue #32, finding 8: a job brought its own Jinja template through
`agent.chat_template_kwargs.chat_template`, rendered in the run worker's event loop: nested loops
stalled every job of that worker. A job's template is now refused unless the operator allows it
(`agent_job_chat_templates`); where allowed it renders in jinja's sandbox (transformers'
ImmutableSandboxedEnvironment) and each rendering stops at its time and memory bound. The
renderer's own parameters (`tokenize`, `tools`, ...) never come from a job."""

from __future__ import annotations

import importlib.metadata

import model_cache
import pytest
from packaging.version import Version

from rollstream.agent import chat as chat_module
from rollstream.agent.chat import ChatRenderer, ChatTemplateRefused, ChatTemplateTooCostly
from rollstream.errors import InvalidJob
from rollstream.messages import Envelope, Job
from rollstream.sandboxes.sandbox_client import SandboxClient
from rollstream.tasks.base import TaskContext
from rollstream.tasks.swe import SweTask, load_instances

MESSAGES = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
                "{% endfor %}{% endfor %}{% endfor %}")
DOUBLING = ("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
            "{{ ns.s | length }}")
ESCAPE = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}<|im_end|>{% endfor %}"


@pytest.fixture(scope="module")
def scripted_model_dir():
    return model_cache.load("scripted_model_dir")


@pytest.fixture(scope="module")
def tokenizer(scripted_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(scripted_model_dir)


@pytest.fixture
def allowed(monkeypatch):
    """The operator allows a job's template, with a short time bound."""
    monkeypatch.setenv("ROLLSTREAM_AGENT_JOB_CHAT_TEMPLATES", "true")
    monkeypatch.setenv("ROLLSTREAM_AGENT_JOB_CHAT_TEMPLATE_TIMEOUT_S", "0.5")


async def test_a_job_bringing_its_own_chat_template_fails_as_the_jobs_fault_before_its_episode(tmp_path):
    job = Job(task="swe", instance=load_instances()[0],
              agent={"chat_template_kwargs": {"chat_template": NESTED_LOOPS}})
    # Refused before the loop or a harness asks for a model or touches the sandbox.
    ctx = TaskContext(node="n", work_dir=tmp_path, sandbox=SandboxClient(str(tmp_path / "no-such.sock")))
    with pytest.raises(ChatTemplateRefused, match="agent_job_chat_templates") as refused:
        await SweTask().rollout(Envelope(job=job), ctx)
    assert isinstance(refused.value, InvalidJob)  # failure 'job', never retried


@pytest.mark.timeout(60)
def test_a_job_template_is_never_rendered_where_the_operator_did_not_allow_it(tokenizer):
    with pytest.raises(ChatTemplateRefused, match="model's own chat template"):
        ChatRenderer(tokenizer, template_kwargs={"chat_template": NESTED_LOOPS}).render(MESSAGES, True)


@pytest.mark.parametrize("parameter",
                         ["tokenize", "tools", "continue_final_message", "return_dict", "tokenizer_kwargs"])
def test_the_renderers_own_parameters_never_come_from_a_job(tokenizer, parameter, allowed):
    with pytest.raises(ChatTemplateRefused, match=parameter):
        ChatRenderer(tokenizer, template_kwargs={parameter: True})


@pytest.mark.timeout(60)
def test_nested_loops_in_an_allowed_job_template_stop_at_the_time_bound(tokenizer, allowed):
    chat = ChatRenderer(tokenizer, template_kwargs={"chat_template": NESTED_LOOPS})
    with pytest.raises(ChatTemplateTooCostly, match="ran past 0.5 s"):
        chat.render(MESSAGES, add_generation_prompt=True)


@pytest.mark.timeout(60)
def test_a_doubling_string_in_an_allowed_job_template_stops_at_the_memory_bound(tokenizer, allowed, monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_AGENT_JOB_CHAT_TEMPLATE_TIMEOUT_S", "30")
    chat = ChatRenderer(tokenizer, template_kwargs={"chat_template": DOUBLING})
    with pytest.raises(ChatTemplateTooCostly, match="grew memory"):
        chat.render(MESSAGES, add_generation_prompt=True)


def test_an_allowed_job_template_renders_in_jinjas_sandbox(tokenizer, allowed):
    with pytest.raises(ChatTemplateRefused, match="SecurityError"):
        ChatRenderer(tokenizer, template_kwargs={"chat_template": ESCAPE}).render(MESSAGES, True)
    chat = ChatRenderer(tokenizer, template_kwargs={"chat_template": PLAIN})
    rendered = chat.render(MESSAGES + [{"role": "assistant", "content": "yo"}], False)
    assert rendered == "<user>hi<|im_end|><assistant>yo<|im_end|>"


def test_the_models_own_template_with_variables_still_renders(tokenizer):
    plain = ChatRenderer(tokenizer).render(MESSAGES, add_generation_prompt=True)
    assert ChatRenderer(tokenizer, template_kwargs={"enable_thinking": False}).render(MESSAGES, True) == plain


def test_jinja2_is_past_its_sandbox_escape_fixes():
    assert Version(importlib.metadata.version("jinja2")) >= Version("3.1.6")


# The renderer remembers the sandbox's verdict per (type, attribute) (agent/chat.py): a verdict
# reached once is the one the sandbox reaches every time, for an attribute read again, after a
# safe one on the same type, or past the most verdicts remembered.
READ_AGAIN = "{% for i in range(3) %}{{ loop.first }}{{ messages.append('x') }}{% endfor %}"
# Its own text, so its own compiled template (they are cached by text) meets the cap of one verdict.
PAST_THE_CAP = "{% for i in range(3) %}{{ loop.last }}{{ loop.first }}{{ messages.pop() }}{% endfor %}"


@pytest.mark.parametrize("template", [READ_AGAIN, PAST_THE_CAP, ESCAPE])
def test_an_unsafe_attribute_stays_refused_however_often_a_job_template_reads_it(tokenizer, allowed, template,
                                                                                  monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_AGENT_JOB_CHAT_TEMPLATE_TIMEOUT_S", "30")
    if template == PAST_THE_CAP:
        monkeypatch.setattr(chat_module, "MAX_REMEMBERED_CHECKS", 1)
    for _ in range(2):  # the second rendering meets the verdicts the first one left
        chat = ChatRenderer(tokenizer, template_kwargs={"chat_template": template})
        with pytest.raises(ChatTemplateRefused, match="SecurityError"):
            chat.render(MESSAGES, add_generation_prompt=True)
