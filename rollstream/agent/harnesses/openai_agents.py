"""The OpenAI Agents SDK (``openai-agents``, unmodified) as a harness: an ``Agent`` on the
SDK's chat-completions model pointed at the job's door, the task's tools as SDK function
tools that run in the job's sandbox, and a ``submit`` tool that ends the run with the answer."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from agents import Tool, TResponseInputItem

    from rollstream.agent.harness import HarnessContext


async def run(ctx: HarnessContext) -> str | None:
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # tracing would export over the network
    from agents import Agent, FunctionTool, OpenAIChatCompletionsModel, RunConfig, Runner, set_tracing_disabled
    from agents.agent import StopAtTools
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    answer: dict = {}

    def sandbox_tool(schema: dict) -> FunctionTool:
        fn = schema.get("function", schema)

        async def invoke(_tool_context, arguments: str) -> str:
            return await ctx.call_tool(fn["name"], json.loads(arguments or "{}"))

        return FunctionTool(name=fn["name"], description=fn.get("description", ""),
                            params_json_schema=fn.get("parameters", {"type": "object", "properties": {}}),
                            on_invoke_tool=invoke, strict_json_schema=False)

    async def submit(_tool_context, arguments: str) -> str:
        answer["answer"] = json.loads(arguments or "{}").get("answer")
        return "submitted"

    tools: list[Tool] = [sandbox_tool(s) for s in ctx.tools]
    tools.append(FunctionTool(name="submit", description="Submit the final answer and end the task.",
                              params_json_schema={"type": "object", "properties": {
                                  "answer": {"type": "string", "description": "final answer"}},
                                  "required": ["answer"]},
                              on_invoke_tool=submit, strict_json_schema=False))
    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    agent = Agent(name="rollstream", instructions=ctx.system_prompt or None, tools=tools,
                  model=OpenAIChatCompletionsModel(model=ctx.model, openai_client=client),
                  tool_use_behavior=StopAtTools(stop_at_tool_names=["submit"]))
    try:
        # The task's messages are Chat's, which the Responses input items take as they are.
        messages = cast("list[TResponseInputItem]", ctx.user_messages)
        result = await Runner.run(agent, messages, max_turns=ctx.settings.max_turns,
                                  run_config=RunConfig(tracing_disabled=True))
    finally:
        await client.close()
    return answer.get("answer", result.final_output)
