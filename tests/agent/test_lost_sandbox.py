"""A sandbox that dies under the agent is the service's failure, not the agent's: the episode
ends with finish reason "error" (the run stage then retries the job in a fresh sandbox)
rather than feeding the agent an error observation it would be scored 0 for."""

from __future__ import annotations

import shutil
import tempfile

import pytest

from rollstream.agent.episode import run_agent
from rollstream.llm.session import LLMSession
from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.results import ToolOutput
from rollstream.sandboxes.supervisor_spawn import stop_fork_server

from .scripted_model import ADD_QUESTION, CALCULATOR, prompt
from .test_agent_loop import GREEDY


class SandboxCalculator:
    """The scripted model's calculator, computed by bash in a real sandbox."""

    def __init__(self, sb: SandboxClient) -> None:
        self.sb = sb

    def schemas(self) -> list[dict]:
        return [CALCULATOR]

    async def call(self, name: str, arguments: dict) -> ToolOutput:
        return await self.sb.call_tool("bash", {"command": f"echo $(({arguments['expression']}))"})


@pytest.fixture
async def root_dir():
    path = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # Unix socket paths stay short
    yield path
    await stop_fork_server(path)
    shutil.rmtree(path, ignore_errors=True)


async def test_a_sandbox_lost_mid_episode_ends_it_as_an_error_not_an_observation(model_server, client, tokenizer,
                                                                                   root_dir):
    handle = await create_sandbox(SandboxSpec(backend="auto"), sandbox_id="lost", owner="test", root_dir=root_dir)
    async with SandboxClient(handle.socket_path) as sb:
        assert (await SandboxCalculator(sb).call("calculator", {"expression": "1 + 1"})).text.strip() == "2"
        await destroy_sandbox(handle)  # the supervisor is gone before the model's first tool call
        traj = await run_agent(prompt(ADD_QUESTION), SandboxCalculator(sb),
                               LLMSession(client, "job-lost", backend_url=model_server), GREEDY, tokenizer)
    assert traj.finish_reason == "error" and "sandbox was lost" in traj.extra["finish_detail"]
    assert traj.num_turns == 1 and not traj.tool_calls  # no error observation was fed to the model
    assert 0 not in traj.loss_mask  # nothing the agent would be scored on was appended after its turn
