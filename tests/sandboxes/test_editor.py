"""The editor tool: directly on a folder, and through a sandbox for path escapes."""

from __future__ import annotations

import os

import pytest

from rollstream.sandboxes import ToolError
from rollstream.sandboxes.runtime.editor import Editor, EditorError, PathMap

from .conftest import needs_bwrap


@pytest.fixture
def editor(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (tmp_path / "outside.txt").write_text("host secret\n")
    return Editor(PathMap("/workspace", [("/workspace", str(work)), ("/tmp", str(tmp_path / "tmp"))]), 10_000)


def test_create_view_with_line_numbers_and_ranges(editor):
    editor.run("create", "pkg/mod.py", file_text="a = 1\nb = 2\nc = 3\n")
    assert editor.run("view", "pkg/mod.py") == "     1\ta = 1\n     2\tb = 2\n     3\tc = 3"
    assert editor.run("view", "/workspace/pkg/mod.py", view_range=[2, -1]) == "     2\tb = 2\n     3\tc = 3"
    with pytest.raises(EditorError, match="outside the file's 3 lines"):
        editor.run("view", "pkg/mod.py", view_range=[2, 9])
    assert "pkg/mod.py" in editor.run("view", ".")


def test_str_replace_needs_a_unique_match(editor):
    editor.run("create", "f.py", file_text="x = 1\nx = 1\ny = 2\n")
    with pytest.raises(EditorError, match="occurs 2 times .*lines 1, 2"):
        editor.run("str_replace", "f.py", old_str="x = 1", new_str="x = 3")
    with pytest.raises(EditorError, match="not found"):
        editor.run("str_replace", "f.py", old_str="z = 9", new_str="")
    editor.run("str_replace", "f.py", old_str="y = 2", new_str="y = 5")
    assert editor.run("view", "f.py").endswith("y = 5")


def test_insert_and_undo(editor):
    editor.run("create", "f.txt", file_text="one\nthree\n")
    editor.run("insert", "f.txt", insert_line=1, new_str="two")
    assert editor.run("view", "f.txt") == "     1\tone\n     2\ttwo\n     3\tthree"
    editor.run("undo_edit", "f.txt")
    assert editor.run("view", "f.txt") == "     1\tone\n     2\tthree"
    editor.run("undo_edit", "f.txt")  # undoes the creation
    with pytest.raises(EditorError, match="does not exist"):
        editor.run("view", "f.txt")
    with pytest.raises(EditorError, match="no edit"):
        editor.run("undo_edit", "f.txt")


def test_paths_cannot_escape_the_workdir(editor, tmp_path):
    with pytest.raises(EditorError, match="outside the sandbox"):
        editor.run("view", "../outside.txt")
    with pytest.raises(EditorError, match="outside the sandbox"):
        editor.run("view", "/etc/passwd")
    os.symlink(str(tmp_path / "outside.txt"), str(tmp_path / "work" / "link.txt"))
    with pytest.raises(EditorError, match="symlink"):
        editor.run("view", "link.txt")


@needs_bwrap
async def test_editor_through_the_socket(sb):
    await sb.edit("create", "hello.py", file_text="print('hello')\n")
    assert (await sb.bash("python3 hello.py")).output == "hello\n"
    with pytest.raises(ToolError, match="outside the sandbox"):
        await sb.edit("view", "/etc/passwd")
