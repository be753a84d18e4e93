"""The tool interface of the agent loop: a ToolBox gives JSON schemas for the chat template
and runs calls, answering a ToolOutput that is never an exception. Sandboxes implement it
(SandboxClient.call_tool); FunctionToolBox wraps plain Python functions."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rollstream.sandboxes.results import ToolOutput  # the one tool-result model, shared with sandboxes


@runtime_checkable
class ToolBox(Protocol):
    """Where the agent's tools run (a sandbox, or in-process functions)."""

    def schemas(self) -> list[dict]:
        """OpenAI-style function schemas: {"type": "function", "function": {...}}."""
        ...

    async def call(self, name: str, arguments: dict) -> ToolOutput:
        """Run one call. Bad names or arguments come back as ToolOutput(ok=False)."""
        ...


def function_schema(name: str, description: str, properties: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": required or list(properties)},
        },
    }


def submit_tool_schema(name: str = "submit") -> dict:
    """The tool that ends the episode; its `answer` goes to eval."""
    return function_schema(
        name, "Submit the final answer and end the task.", {"answer": {"type": "string", "description": "final answer"}}
    )


def schema_name(schema: dict) -> str:
    return schema.get("function", schema).get("name", "")


@dataclass
class FunctionToolBox:
    """Tools that are Python functions (sync or async) taking keyword arguments and
    returning text. For tasks that need no sandbox, and for tests of the loop."""

    tools: dict[str, tuple[dict, Callable[..., Any]]] = field(default_factory=dict)

    def add(self, schema: dict, fn: Callable[..., str | Awaitable[str]]) -> FunctionToolBox:
        self.tools[schema_name(schema)] = (schema, fn)
        return self

    def schemas(self) -> list[dict]:
        return [schema for schema, _ in self.tools.values()]

    async def call(self, name: str, arguments: dict) -> ToolOutput:
        if name not in self.tools:
            known = ", ".join(self.tools) or "none"
            return ToolOutput(text=f"Error: unknown tool {name!r}; available: {known}", ok=False, error="unknown tool")
        _, fn = self.tools[name]
        try:
            result = fn(**arguments)
            if inspect.isawaitable(result):
                result = await result
        except TypeError as exc:  # wrong or missing arguments: the model can fix them
            return ToolOutput(text=f"Error: bad arguments for {name}: {exc}", ok=False, error=str(exc))
        except Exception as exc:  # a failing tool is an observation, not a crashed episode
            return ToolOutput(text=f"Error: {type(exc).__name__}: {exc}", ok=False, error=str(exc))
        return ToolOutput(text=str(result))


class CallToolAdapter:
    """Fits an object with `async call_tool(name, arguments)` (e.g. SandboxClient) and a
    schema list to the ToolBox protocol. Only the tools of that list are called: a call of
    another tool the target has (the sandbox's ipython, where the task offers bash and the
    editor) is answered as unknown, as the model was never told of it."""

    def __init__(self, target: Any, schemas: list[dict]) -> None:
        self.target = target
        self._schemas = list(schemas)
        self._names = {schema_name(schema) for schema in self._schemas}

    def schemas(self) -> list[dict]:
        return list(self._schemas)

    async def call(self, name: str, arguments: dict) -> ToolOutput:
        if name not in self._names:
            offered = ", ".join(sorted(self._names)) or "none"
            return ToolOutput(text=f"Error: unknown tool {name!r}; available: {offered}", ok=False,
                              error="unknown tool")
        return await self.target.call_tool(name, arguments)


async def call_with_timeout(tools: ToolBox, name: str, arguments: dict, timeout_s: float) -> ToolOutput:
    """One call bounded in time; a timeout or an exception becomes an error observation."""
    try:
        return await asyncio.wait_for(tools.call(name, arguments), timeout_s)
    except TimeoutError:
        return ToolOutput(text=f"Error: tool {name} timed out after {timeout_s:.0f}s", ok=False, error="timeout")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the ToolBox contract says never raise; keep the episode alive anyway
        return ToolOutput(text=f"Error: tool {name} failed: {type(exc).__name__}: {exc}", ok=False, error=str(exc))
