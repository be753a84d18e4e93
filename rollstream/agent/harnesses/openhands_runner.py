"""The command line of the OpenHands SDK preset (rollstream/data/harnesses/openhands-sdk.toml): runs
the SDK's agent, unmodified, headless on one task in the current folder and exits. The SDK is a
library and ships no command of its own (its documented way to run an agent is a short script:
an ``LLM``, an ``Agent`` with its tools, a ``Conversation`` on a workspace, ``send_message``,
``run``); this is that script, with options, so that the preset file stays declarative.

It runs inside the job's sandbox with the preset's own Python (the SDK needs >= 3.12) and imports
only the standard library and the SDK, nothing of rollstream. ``rollstream harnesses install
openhands-sdk`` copies it into the preset's prefix (``bin/rollstream-openhands``). The model is
reached through litellm's OpenAI provider at ``--base-url`` (the job's door), with the SDK's own
native tool calling. Its answer (the finish tool's message, or the agent's last message) is
printed as the last line of its output and written to ``--output`` as JSON; it exits 0 when the
agent finished, 1 when it stopped otherwise (an error, stuck, out of iterations)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TOOLS = ("terminal", "file_editor", "task_tracker")  # the SDK's default tools without a browser


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="rollstream-openhands", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", required=True, help="What the agent is asked (its first user message).")
    parser.add_argument("--model", default=os.environ.get("LLM_MODEL", "openai/rollstream"),
                        help="litellm model name (default $LLM_MODEL; 'openai/NAME' for an OpenAI-compatible door).")
    parser.add_argument("--base-url", default=os.environ.get("LLM_BASE_URL"), help="default $LLM_BASE_URL")
    parser.add_argument("--api-key", default=os.environ.get("LLM_API_KEY", ""), help="default $LLM_API_KEY")
    parser.add_argument("--tools", default=",".join(TOOLS),
                        help=f"comma-separated tools of openhands-tools among {', '.join(TOOLS)}")
    parser.add_argument("--no-think-tool", action="store_true", help="offer the finish tool alone of the builtins")
    parser.add_argument("--system-prompt-file", default=None,
                        help="a system prompt template (jinja, absolute path) in place of the SDK's own")
    parser.add_argument("--max-iterations", type=int, default=100, help="the agent's steps before it is stopped")
    parser.add_argument("--num-retries", type=int, default=0,
                        help="litellm retries of a failed call (default 0: the door's refusals are final)")
    parser.add_argument("--reasoning-effort", default=None,
                        help="sent to the model when set (default: not sent; the door's job decides how it samples)")
    parser.add_argument("--output", default=None, help="write {final_message, status, iterations} here as JSON")
    return parser.parse_args(argv)


def build_agent(args: argparse.Namespace):  # -> openhands.sdk.Agent
    from openhands.sdk import LLM, Agent, Tool
    from openhands.tools.file_editor import FileEditorTool
    from openhands.tools.task_tracker import TaskTrackerTool
    from openhands.tools.terminal import TerminalTool

    known = {"terminal": (TerminalTool.name, {"terminal_type": "subprocess"}),  # no tmux needed in the sandbox
             "file_editor": (FileEditorTool.name, {}), "task_tracker": (TaskTrackerTool.name, {})}
    wanted = [name.strip() for name in args.tools.split(",") if name.strip()]
    unknown = sorted(set(wanted) - set(known))
    if unknown:
        raise SystemExit(f"rollstream-openhands: unknown tools {unknown}; choose among {', '.join(known)}")
    llm = LLM(model=args.model, base_url=args.base_url, api_key=args.api_key or None, num_retries=args.num_retries,
              reasoning_effort=args.reasoning_effort, usage_id="agent")
    extra: dict = {}
    if args.system_prompt_file:
        extra["system_prompt_filename"] = str(Path(args.system_prompt_file).resolve())
    if args.no_think_tool:
        extra["include_default_tools"] = ["FinishTool"]
    return Agent(llm=llm, tools=[Tool(name=known[n][0], params=known[n][1]) for n in wanted], **extra)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from openhands.sdk import Conversation
    from openhands.sdk.conversation.response_utils import get_agent_final_response

    conversation = Conversation(agent=build_agent(args), workspace=os.getcwd(), visualizer=None,
                                max_iteration_per_run=args.max_iterations)
    status, error = "error", None
    try:
        conversation.send_message(args.task)
        conversation.run()
        status = str(getattr(conversation.state.execution_status, "value", conversation.state.execution_status))
    except Exception as exc:  # noqa: BLE001 -- the SDK's own failure (a refused call, a broken tool): exit 1
        error = f"{type(exc).__name__}: {exc}"
    final = get_agent_final_response(conversation.state.events)
    iterations = sum(1 for e in conversation.state.events if getattr(e, "source", None) == "agent")
    if args.output:
        Path(args.output).write_text(json.dumps({"final_message": final, "status": status, "error": error,
                                                 "iterations": iterations}))
    if error:
        print(f"rollstream-openhands: the agent stopped: {error}", file=sys.stderr)
    print(final.strip().splitlines()[-1] if final.strip() else "")
    return 0 if status == "finished" and error is None else 1


if __name__ == "__main__":
    sys.exit(main())
