"""Model-produced tool calls: schemas, validation, and errors as ToolOutput, never raised."""

from __future__ import annotations

from rollstream.sandboxes import tool_schemas

from .conftest import needs_bwrap


def test_schemas_are_openai_functions():
    schemas = tool_schemas(["bash", "editor"])
    assert [s["function"]["name"] for s in schemas] == ["bash", "editor"]
    bash = schemas[0]["function"]["parameters"]
    assert bash["type"] == "object" and bash["required"] == ["command"]
    assert "str_replace" in str(schemas[1])


@needs_bwrap
async def test_calls_and_bad_arguments(sb):
    ok = await sb.call_tool("bash", '{"command": "echo hi; (exit 3)"}')
    assert ok.ok and ok.text == "hi\n\n[exit code: 3]"
    assert (await sb.call_tool("ipython", {"code": "6*7"})).text == "Out[1]: 42"

    for name, arguments, expected in [
        ("bash", "{not json", "not valid JSON"),
        ("bash", {"cmd": "ls"}, "command: Field required"),
        ("bash", {"command": "ls", "timeout": -1}, "timeout"),
        ("editor", {"command": "delete", "path": "x"}, "command"),
        ("editor", {"command": "view", "path": "/etc"}, "outside the sandbox"),
        ("editor", {"command": "str_replace", "path": "nope.py", "old_str": "a", "new_str": "b"}, "does not exist"),
        ("browser", {}, "unknown tool"),
    ]:
        output = await sb.call_tool(name, arguments)
        assert not output.ok and expected in output.error, (name, arguments, output)
        assert output.text.startswith("Error:")
