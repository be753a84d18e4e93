"""The host side of verification in a fresh sandbox: eval (root on a bwrap node) reads the
agent's checkout from the host. What the agent put there must never make it read or block on
anything but the checkout's own regular files (tasks/verification.py)."""

from __future__ import annotations

import io
import os
import socket
import tarfile

import pytest

from rollstream.tasks.verification import VerificationRefused, read_tree


def members(tree) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(tree.tar)) as tar:
        return {m.name: m for m in tar.getmembers()}


def contents(tree) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tree.tar)) as tar:
        return b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())


@pytest.fixture
def checkout(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("x = 1\n")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "config").write_text("[core]\n\tfsmonitor = /evil\n")
    return tmp_path


def test_symlinks_to_host_files_and_folders_stay_links_never_read(checkout):
    secret = checkout.parent / "host-secret"
    secret.write_text("root:HOST-SECRET\n")
    (checkout / "pkg" / "secret.py").symlink_to(secret)
    (checkout / "etc").symlink_to("/etc")
    tree = read_tree(str(checkout))
    found = members(tree)
    assert found["pkg/secret.py"].issym() and found["pkg/secret.py"].linkname == str(secret)
    assert found["etc"].issym() and not any(name.startswith("etc/") for name in found)
    assert b"HOST-SECRET" not in contents(tree) and b"root:" not in contents(tree)


def test_fifos_sockets_and_hard_links_are_refused_by_name_and_never_opened(checkout):
    os.mkfifo(checkout / "pkg" / "pipe")  # opening it to read would block eval forever
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(checkout / "sock"))
        os.link(checkout / "pkg" / "mod.py", checkout / "pkg" / "alias.py")
        tree = read_tree(str(checkout))
    assert sorted(tree.refused) == ["pkg/alias.py (hard link)", "pkg/mod.py (hard link)", "pkg/pipe (FIFO)",
                                    "sock (socket)"]
    assert set(members(tree)) == set()


def test_git_folder_and_caches_never_travel(checkout):
    (checkout / "pkg" / "__pycache__").mkdir()
    (checkout / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    tree = read_tree(str(checkout))
    assert set(members(tree)) == {"pkg/mod.py"}


def test_a_checkout_past_the_size_limit_is_refused_not_read_whole(checkout):
    (checkout / "big.bin").write_bytes(b"\0" * 4096)
    with pytest.raises(VerificationRefused, match="more than"):
        read_tree(str(checkout), max_bytes=1024)


def test_a_checkout_that_is_a_symlink_is_refused(checkout, tmp_path_factory):
    link = tmp_path_factory.mktemp("other") / "repo"
    link.symlink_to(checkout)
    with pytest.raises(VerificationRefused, match="cannot be opened"):
        read_tree(str(link))


def test_a_whole_workdir_keeps_git_folders_and_modes_and_still_refuses_special_files(checkout):
    """A Harbor task's workdir (``whole``): its state may live anywhere, .git and caches included;
    links still come last and stay links, special files are still refused by name."""
    (checkout / "pkg" / "__pycache__").mkdir()
    (checkout / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\0")
    (checkout / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(checkout / "run.sh", 0o750)
    (checkout / "etc").symlink_to("/etc")
    os.mkfifo(checkout / "pipe")
    tree = read_tree(str(checkout), whole=True)
    found = members(tree)
    assert {".git", ".git/config", "pkg", "pkg/__pycache__", "pkg/__pycache__/mod.cpython-311.pyc",
            "pkg/mod.py", "run.sh", "etc"} == set(found)
    assert found["pkg"].isdir() and found["run.sh"].mode == 0o750
    assert list(found)[-1] == "etc" and found["etc"].issym()
    assert tree.refused == ["pipe (FIFO)"]
    with pytest.raises(VerificationRefused, match="more than 3 entries"):
        read_tree(str(checkout), max_files=3, whole=True)
