"""One episode of a verifiers environment (Prime Intellect's ``verifiers``, its classic
``load_environment`` API) on the run worker: the environment is loaded by its id from the installed
packages the operator allows (``Settings.verifiers_environments``), its dataset row is the instance,
its own turn protocol (``Environment.run_rollout``: single-turn, ``env_response``, tool calls) drives
the episode, and its rubric scores it. The model is reached through the job's door
(agent/gateway.py) with an OpenAI client, so every call is rendered with the served model's chat
template and recorded token for token. ``run`` is the harness the ``verifiers`` task hands
to ``run_harness``; what the environment returned waits in ``outcomes`` for the task."""

from __future__ import annotations

import contextvars
import importlib.util
import json
import logging
import math
import re
import signal
from dataclasses import dataclass, field
from typing import Any

from rollstream.config import load_settings
from rollstream.errors import InvalidJob, JobFailed
from rollstream.tasks import verifiers_sandbox

log = logging.getLogger(__name__)

ENV_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,99}")
SPLITS = ("train", "eval")
MAX_KEPT_CHARS = 20_000  # of the environment's completion messages, kept with the trajectory
# Environments a worker process keeps loaded (one per environment id and arguments): verifiers
# registers each for teardown at exit, so one loaded is never freed; jobs varying the arguments
# without end must not grow a worker without end.
MAX_ENVIRONMENTS = 64


def module_name(env_id: str) -> str:
    """The module an environment id names, as verifiers' own loader reads it."""
    return env_id.replace("-", "_")


def check_allowed(env_id: Any) -> str:
    """``env_id`` if it is an id the operator allows; InvalidJob saying what to do otherwise."""
    if not isinstance(env_id, str) or not ENV_ID.fullmatch(env_id):
        raise InvalidJob(f"verifiers: environment must be an environment id such as 'reverse-text' (letters, digits, "
                         f"'-' and '_'; never a path), got {env_id!r}")
    allowed = load_settings().verifiers_environments
    if env_id not in allowed and module_name(env_id) not in allowed:
        raise InvalidJob(f"verifiers environment {env_id!r} is not allowed here; the operator lists the environments "
                         f"jobs may load in ROLLSTREAM_VERIFIERS_ENVIRONMENTS (a JSON list; now "
                         f"{json.dumps(allowed)})")
    return env_id


@dataclass
class Outcome:
    """What an episode left for the task: the environment's scored rollout, or why it failed."""

    reward: float | None = None
    metrics: dict[str, float | None] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the environment's own failure (the task's fault, never retried)


# job id -> the episode's outcome; the task registers a job before the harness runs (``expect``)
outcomes: dict[str, Outcome | None] = {}
_environments: dict[str, Any] = {}
_rubric_errors: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("rubric_errors", default=None)


class _RubricErrors(logging.Handler):
    """verifiers' Rubric logs a reward function that raised and scores it 0; an episode wants it
    as its error instead (a broken environment must not train the policy on made-up zeros)."""

    def emit(self, record: logging.LogRecord) -> None:
        errors = _rubric_errors.get()
        if errors is not None and record.levelno >= logging.ERROR:
            errors.append(record.getMessage())


_handler = _RubricErrors()


def load_environment(env_id: str, args: dict) -> Any:
    """The environment of ``env_id`` built with ``args``, once per worker process. verifiers'
    Environment takes SIGINT and SIGTERM for its own teardown when it is made; the worker's
    handlers are put back, so a worker still stops as a worker."""
    key = json.dumps([env_id, args], sort_keys=True)
    if key in _environments:
        return _environments[key]
    check_allowed(env_id)
    if len(_environments) >= MAX_ENVIRONMENTS:
        raise JobFailed(f"this worker holds {MAX_ENVIRONMENTS} verifiers environments (ids with their arguments) "
                        "already, the most it loads; vary load_environment's arguments less, or restart the worker",
                        retryable=True)
    if importlib.util.find_spec(module_name(env_id)) is None:
        raise JobFailed(f"verifiers environment {env_id!r} is allowed but not installed on this worker (no module "
                        f"{module_name(env_id)!r}); install its package on the run workers", retryable=False,
                        failure="job")
    import datasets
    import verifiers as vf

    datasets.disable_progress_bars()  # a bar per dataset map, written into the worker's log
    logging.getLogger("verifiers.legacy.rubrics").addHandler(_handler)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as exc:  # any error of the package's own code: the task's fault, said as it is
        raise JobFailed(f"verifiers environment {env_id!r} failed to load with args {json.dumps(args)}: "
                        f"{_cause(exc)}", retryable=False, failure="task") from exc
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
    if not isinstance(env, vf.Environment):
        raise JobFailed(f"verifiers environment {env_id!r}: load_environment returned {type(env).__name__}, not a "
                        "verifiers Environment", retryable=False, failure="task")
    _environments[key] = verifiers_sandbox.adopt(env)
    return env


def dataset_row(env: Any, split: str, index: int) -> dict:
    dataset = env.get_eval_dataset() if split == "eval" else env.get_dataset()
    if not 0 <= index < len(dataset):
        raise JobFailed(f"verifiers environment {env.env_id!r}: its {split} dataset has {len(dataset)} rows, no row "
                        f"{index}", retryable=False, failure="job")
    return dict(dataset[index])


async def run(ctx) -> None:
    """The harness: one rollout of the job's environment through the door, scored by its rubric."""
    if ctx.job_id not in outcomes:
        raise RuntimeError("the verifiers-env harness runs the episodes of verifiers jobs only "
                           "(task 'verifiers'); it is not an agent for other tasks")
    instance = ctx.instance
    env_id, args = instance["environment"], instance.get("args") or {}
    outcome = Outcome()
    outcomes[ctx.job_id] = outcome
    env = load_environment(env_id, args)
    if env.rubric.has_group_rewards:
        raise JobFailed(f"verifiers environment {env_id!r} scores with group reward functions, which need the "
                        "group's rollouts together; a verifiers job is one rollout", retryable=False, failure="task")
    row = dataset_row(env, instance.get("split", "train"), int(instance.get("index", 0)))
    import verifiers as vf
    from openai import AsyncOpenAI

    if verifiers_sandbox.is_sandbox_env(env) and ctx.sandbox is None:
        raise JobFailed(f"verifiers environment {env_id!r} runs commands in a sandbox, and this job has none",
                        retryable=False, failure="job")
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    errors: list[str] = []
    token = _rubric_errors.set(errors)
    episode = verifiers_sandbox.current_episode.set(ctx)
    try:
        output = await env.run_rollout(row, vf.OpenAIChatCompletionsClient(client), ctx.model,
                                       dict(env.sampling_args))
    except (JobFailed, InvalidJob):
        raise
    except Exception as exc:  # the environment's own code raised (env_response, a stop condition, set-up)
        outcome.error = f"verifiers environment {env_id!r} raised during its rollout: {_cause(exc)}"
        log.warning("job %s: %s", ctx.job_id, outcome.error, exc_info=True)
        return
    finally:
        _rubric_errors.reset(token)
        verifiers_sandbox.current_episode.reset(episode)
        if isinstance(getattr(env, "sandbox_client", None), verifiers_sandbox.JobSandboxClient):
            env.sandbox_client.episodes.pop(ctx.job_id, None)
        await client.close()
    if errors:
        outcome.error = f"verifiers environment {env_id!r}: its rubric failed: {'; '.join(errors)[:2000]}"
        return
    outcome.reward = _number(output.get("reward"))
    outcome.metrics = {name: _number(value) for name, value in (output.get("metrics") or {}).items()}
    outcome.weights = rubric_weights(env.rubric)
    error = output.get("error")  # verifiers' ErrorData: the error and its chain, as text
    if isinstance(error, dict):
        error = error.get("error_chain_repr") or error.get("message") or error  # repr: with each one's message
    outcome.detail = {
        "environment": env_id, "args": args, "split": instance.get("split", "train"), "index": instance.get("index", 0),
        "answer": _plain(output.get("answer", "")), "stop_condition": output.get("stop_condition"),
        "is_truncated": bool(output.get("is_truncated")), "error": None if error is None else str(error)[:2000],
        "completion": _clipped(_plain(output.get("completion"))),
    }
    return


def rubric_weights(rubric: Any) -> dict[str, float]:
    """Each reward function's weight by name (a RubricGroup's rubrics in order)."""
    weights: dict[str, float] = {}
    for part in getattr(rubric, "rubrics", None) or [rubric]:
        for func, weight in zip(part.funcs, part.weights):
            weights[getattr(func, "__name__", repr(func))] = float(weight)
    return weights


def _cause(exc: BaseException) -> str:
    """The error and what caused it (verifiers wraps a package's own error in its own)."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 3:
        parts.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__
    return " <- ".join(parts)[:2000]


def _number(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _plain(value: Any) -> Any:
    """The environment's messages and values as plain JSON data (pydantic messages dumped)."""
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(exclude_none=True))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return str(value)


def _clipped(messages: Any) -> Any:
    text = json.dumps(messages)
    return messages if len(text) <= MAX_KEPT_CHARS else {"clipped": text[:MAX_KEPT_CHARS]}
