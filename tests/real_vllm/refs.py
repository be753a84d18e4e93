"""What the tests compare vLLM's answers with: the model recomputed in this process (fp32
transformers), and the agent's tool box for the arith task (a real bash)."""

from __future__ import annotations

import asyncio

from llm.llm_refs import recompute_logprobs

from rollstream.agent.tools import FunctionToolBox
from rollstream.tasks import arith


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def trajectory_logprob_error(model, traj) -> float:
    """Largest gap between the trajectory's logprobs and the model's own, on generated tokens."""
    ids = traj.prompt_ids + traj.response_ids
    recomputed = recompute_logprobs(model, traj.prompt_ids, traj.response_ids)
    assert len(recomputed) == len(ids) - len(traj.prompt_ids)
    return max(abs(a - b) for a, b, m in zip(recomputed, traj.logprobs, traj.loss_mask) if m)


async def bash(command: str) -> str:
    proc = await asyncio.create_subprocess_exec("bash", "-c", command, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 30)
    return out.decode(errors="replace")


def arith_tools() -> FunctionToolBox:
    return FunctionToolBox().add(arith.BASH_SCHEMA, bash)
