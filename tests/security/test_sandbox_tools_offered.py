"""Issue 32, finding 1 (its aside): an `ipython` call reached the sandbox's kernel even where the
task offered only bash and the editor. The agent loop, and a harness's `call_tool`, now call only
the tools the task's schemas name; another is answered as an unknown tool and never reaches the
sandbox."""

from __future__ import annotations

from sandboxes.conftest import needs_bwrap, root_dir, sandbox, sb  # noqa: F401  (fixtures)

from rollstream.agent.harness import HarnessContext
from rollstream.agent.tools import CallToolAdapter
from rollstream.episode_settings import AgentSettings
from rollstream.sandboxes.tools import tool_schemas

pytestmark = needs_bwrap


async def test_a_tool_the_task_does_not_offer_never_reaches_the_sandbox(sb):
    tools = CallToolAdapter(sb, tool_schemas(["bash", "editor"]))
    output = await tools.call("ipython", {"code": "open('/tmp/kernel-ran', 'w').close()"})
    info = await sb.info()
    assert not info["kernel_alive"], "a kernel started for a tool the task does not offer"
    assert (await sb.bash("test -e /tmp/kernel-ran")).exit_code == 1
    assert not output.ok and output.error == "unknown tool" and "bash, editor" in output.text
    offered = await tools.call("bash", {"command": "echo offered"})
    assert offered.ok and offered.text.startswith("offered")


async def test_a_harness_calling_a_tool_the_task_does_not_offer_never_reaches_the_sandbox(sb):
    context = HarnessContext(job_id="j1", instance={}, messages=[], tools=tool_schemas(["bash"]), base_url="",
                             api_key="", settings=AgentSettings(), sandbox=sb)
    observation = await context.call_tool("ipython", {"code": "open('/tmp/kernel-ran', 'w').close()"})
    assert not (await sb.info())["kernel_alive"], "a kernel started for a tool the task does not offer"
    assert observation.startswith("Error: unknown tool 'ipython'") and context.tool_calls[-1].error == "unknown tool"
    assert (await context.call_tool("bash", {"command": "echo offered"})).startswith("offered")
