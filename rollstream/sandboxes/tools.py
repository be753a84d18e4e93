"""Tool calls from the model: OpenAI-style schemas and a dispatcher that never raises.

The run stage puts `tool_schemas([...])` in the chat template's `tools`, parses the
model's calls and hands each to `SandboxClient.call_tool`, which validates the arguments
here and turns every failure into a ToolOutput(ok=False) the model can read and fix.
"""

from __future__ import annotations

import json
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import SandboxError, SandboxGone, ToolError
from .results import BashResult, EditResult, IPythonResult, ToolOutput


class ToolTarget(Protocol):
    """What the tools run on: a SandboxClient (sandbox_client.py), which calls `call_tool` here."""

    async def bash(self, command: str, timeout_s: float | None = None) -> BashResult: ...

    async def ipython(self, code: str, timeout_s: float | None = None) -> IPythonResult: ...

    async def edit(self, command: str, path: str, file_text: str | None = None, old_str: str | None = None,
                   new_str: str | None = None, insert_line: int | None = None,
                   view_range: list[int] | None = None) -> EditResult: ...


class BashArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    command: str = Field(description="The bash command to run. State (cwd, env) persists between calls.")
    timeout: float | None = Field(None, gt=0, le=3600, description="Seconds before the command is interrupted.")


class IPythonArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(description="Python code to run in a persistent IPython kernel.")
    timeout: float | None = Field(None, gt=0, le=3600, description="Seconds before the cell is interrupted.")


class EditorArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    command: Literal["view", "create", "str_replace", "insert", "undo_edit"] = Field(
        description="view a file or folder, create a file, str_replace a unique snippet, insert after a "
        "line, or undo_edit the last edit of a file"
    )
    path: str = Field(description="File or folder path, relative to the working directory or absolute inside it.")
    file_text: str | None = Field(None, description="create: the whole content of the new file.")
    old_str: str | None = Field(None, description="str_replace: exact text to replace; must occur exactly once.")
    new_str: str | None = Field(None, description="str_replace: replacement text; insert: text to insert.")
    insert_line: int | None = Field(None, ge=0, description="insert: insert after this line (0 = at the top).")
    view_range: list[int] | None = Field(
        None, description="view: [start, end] line numbers, 1-based, end -1 for the end of the file."
    )


_TOOLS: dict[str, tuple[type[BaseModel], str]] = {
    "bash": (BashArgs, "Run a command in a persistent bash shell inside the sandbox and return its output."),
    "ipython": (IPythonArgs, "Run Python code in a persistent IPython kernel inside the sandbox."),
    "editor": (EditorArgs, "View, create and edit text files in the sandbox's working directory."),
}


def tool_schemas(names: list[str] | None = None) -> list[dict]:
    """OpenAI-style function schemas for the given tool names (default: all)."""
    names = list(_TOOLS) if names is None else names
    schemas = []
    for name in names:
        if name not in _TOOLS:
            raise ValueError(f"unknown tool {name!r}; available tools: {', '.join(_TOOLS)}")
        model, description = _TOOLS[name]
        parameters = model.model_json_schema()
        parameters.pop("title", None)
        for field in parameters.get("properties", {}).values():
            field.pop("title", None)
        schemas.append(
            {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}
        )
    return schemas


def _error(message: str) -> ToolOutput:
    return ToolOutput(text=f"Error: {message}", ok=False, error=message)


async def call_tool(client: ToolTarget, name: str, arguments: dict | str) -> ToolOutput:
    """Validate and run one tool call; any failure becomes ToolOutput(ok=False, error=...)."""
    if name not in _TOOLS:
        return _error(f"unknown tool {name!r}; call one of: {', '.join(_TOOLS)}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:
            return _error(f"the arguments are not valid JSON ({error}); send a JSON object")
    if not isinstance(arguments, dict):
        return _error("the arguments must be a JSON object")
    model, _ = _TOOLS[name]
    try:
        args = model.model_validate(arguments)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in error.errors())
        return _error(f"bad arguments for {name}: {problems}")
    try:
        if isinstance(args, BashArgs):
            return _bash_output(await client.bash(args.command, timeout_s=args.timeout))
        if isinstance(args, IPythonArgs):
            return _ipython_output(await client.ipython(args.code, timeout_s=args.timeout))
        assert isinstance(args, EditorArgs)
        result = await client.edit(**args.model_dump(exclude_none=True))
        return ToolOutput(text=result.output)
    except ToolError as error:
        return _error(str(error).split("\nTraceback")[0])
    except SandboxGone as error:
        return ToolOutput(text=f"Error: {error}", ok=False, error=str(error), sandbox_lost=True)
    except SandboxError as error:
        return _error(str(error))


def _bash_output(result: BashResult) -> ToolOutput:
    text = result.output
    if result.exit_code not in (0, None):
        text += f"\n[exit code: {result.exit_code}]"
    if result.note:
        text += f"\n[{result.note}]"
    return ToolOutput(text=text)


def _ipython_output(result: IPythonResult) -> ToolOutput:
    parts = [part for part in (result.stdout, result.stderr) if part]
    if result.result is not None:
        parts.append(f"Out[{result.execution_count}]: {result.result}")
    if result.error:
        parts.append(result.error)
    if result.images_png_b64:
        parts.append(f"[{len(result.images_png_b64)} image(s)]")
    if result.note:
        parts.append(f"[{result.note}]")
    return ToolOutput(text="\n".join(parts), images_png_b64=result.images_png_b64)
