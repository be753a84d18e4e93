"""The smallest harness: the official ``openai`` client in a tool-calling loop, the shape of
most home-grown agents. It runs the task's tools in the job's sandbox and returns the
argument of its ``submit`` call as the answer."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

    from rollstream.agent.harness import HarnessContext

SUBMIT: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": "submit", "description": "Submit the final answer and end the task.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "final answer"}},
                   "required": ["answer"]}}}


async def run(ctx: HarnessContext) -> str | None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    # The task's messages and tools are Chat's own shapes, as dicts: the SDK's TypedDicts describe them.
    messages = cast("list[ChatCompletionMessageParam]", list(ctx.messages))
    tools = [*cast("list[ChatCompletionFunctionToolParam]", ctx.tools), SUBMIT]
    try:
        for _turn in range(ctx.settings.max_turns):
            reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                          tools=tools)).choices[0].message
            messages.append(cast("ChatCompletionMessageParam", reply.model_dump(exclude_none=True)))
            if not reply.tool_calls:
                return reply.content
            for call in reply.tool_calls:
                if call.type != "function":  # custom (free-text) tools: none is offered
                    continue
                arguments = json.loads(call.function.arguments or "{}")
                if call.function.name == "submit":
                    return arguments.get("answer")
                output = await ctx.call_tool(call.function.name, arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        return None
    finally:
        await client.close()
