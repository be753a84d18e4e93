"""What the built-in tasks (math, code, swe) share in their eval stage: reading the
agent's submitted answer, the eval time limit of an instance, and recording why a reward
is what it is in ``trajectory.extra["eval"]`` so the submitter sees the reason."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from rollstream.errors import InvalidJob
from rollstream.messages import Envelope
from rollstream.trajectory import Trajectory

DEFAULT_EVAL_TIMEOUT_S = 60.0
DETAIL_CHARS = 2000


def submitted_answer(env: Envelope) -> Any:
    """The submit tool's ``answer`` (or its whole argument map), None if never submitted."""
    if env.trajectory is None:
        return None
    answer = env.trajectory.extra.get("answer")
    if isinstance(answer, dict) and "answer" in answer:
        answer = answer["answer"]
    return answer


def response_text(env: Envelope) -> str:
    return env.trajectory.response_text if env.trajectory is not None else ""


def eval_timeout_s(instance: dict, default: float = DEFAULT_EVAL_TIMEOUT_S) -> float:
    return float(instance.get("eval_timeout_s", default))


def check_eval_timeout(instance: dict) -> None:
    value = instance.get("eval_timeout_s", DEFAULT_EVAL_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 24 * 3600:
        raise InvalidJob(f"eval_timeout_s must be a number of seconds in (0, 86400], got {value!r}")


def record(env: Envelope, reward: float, reason: str, **detail: Any) -> float:
    """Keep the reward's reason (and details) with the trajectory; returns ``reward``."""
    if env.trajectory is None:
        env.trajectory = Trajectory()
    clipped = {k: (v[-DETAIL_CHARS:] if isinstance(v, str) else v) for k, v in detail.items()}
    env.trajectory.extra["eval"] = {"reward": reward, "reason": reason[:DETAIL_CHARS], **clipped}
    return reward


async def within_limit(env: Envelope, limit_s: float, score: Callable[[], Awaitable[float]]) -> float:
    """Run ``score`` under the instance's eval time limit; past it the reward is 0 with
    the reason, and the eval worker moves on (the sandbox is destroyed by teardown)."""
    try:
        return await asyncio.wait_for(score(), limit_s)
    except TimeoutError:
        return record(env, 0.0, f"eval exceeded its time limit of {limit_s:g} s (instance eval_timeout_s)")
