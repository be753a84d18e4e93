"""The smallest harness: the official ``openai`` client in a tool-calling loop, the shape of
most home-grown agents. It runs the task's tools in the job's sandbox and returns the
argument of its ``submit`` call as the answer."""

from __future__ import annotations

import json

SUBMIT = {"type": "function", "function": {
    "name": "submit", "description": "Submit the final answer and end the task.",
    "parameters": {"type": "object", "properties": {"answer": {"type": "string", "description": "final answer"}},
                   "required": ["answer"]}}}


async def run(ctx) -> str | None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages = list(ctx.messages)
    try:
        for _turn in range(ctx.settings.max_turns):
            reply = (await client.chat.completions.create(model=ctx.model, messages=messages,
                                                          tools=[*ctx.tools, SUBMIT])).choices[0].message
            messages.append(reply.model_dump(exclude_none=True))
            if not reply.tool_calls:
                return reply.content
            for call in reply.tool_calls:
                arguments = json.loads(call.function.arguments or "{}")
                if call.function.name == "submit":
                    return arguments.get("answer")
                output = await ctx.call_tool(call.function.name, arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
        return None
    finally:
        await client.close()
