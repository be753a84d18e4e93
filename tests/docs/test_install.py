"""The README's first promise: on a stock Debian 12 with only the system Python, scripts/install
(what scripts/demo and scripts/test run first) installs into the project's .venv — Debian's
/usr/bin/python3 refuses pip installs outside a venv (PEP 668) — and a second run installs
nothing. Run from a clean copy of the checkout with PATH=/usr/bin:/bin; pip's own cache and
configured wheel folders keep it cheap."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from .blocks import ROOT

SYSTEM_PYTHON = Path("/usr/bin/python3")

pytestmark = pytest.mark.slow


def _clean_copy(dest: Path) -> None:
    """The checkout's files as git knows them (tracked and not ignored), without .venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, (n.decode() for n in listed)):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _system_env() -> dict[str, str]:
    """A login's environment on a stock machine: the system PATH, and pip's own configuration."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_") or k in ("HOME", "LANG", "USER", "TERM")}
    env["PATH"] = "/usr/bin:/bin"
    return env


def test_scripts_install_makes_a_venv_with_the_system_python_and_a_second_run_installs_nothing():
    if not (SYSTEM_PYTHON.exists() and list(Path("/usr/lib").glob("python3*/EXTERNALLY-MANAGED"))):
        pytest.fail("this check needs Debian's /usr/bin/python3 with its PEP 668 marker (a stock Debian 12)")
    # The premise: the system interpreter refuses a plain pip install (PEP 668).
    refused = subprocess.run([str(SYSTEM_PYTHON), "-m", "pip", "install", "--dry-run", "rollstream-not-a-package"],
                             capture_output=True, text=True, env=_system_env())
    assert refused.returncode != 0 and "externally-managed-environment" in refused.stdout + refused.stderr

    base = Path(tempfile.mkdtemp(prefix="rsi-", dir="/tmp"))
    try:
        repo = base / "checkout"
        _clean_copy(repo)
        first = subprocess.run(["bash", "scripts/install", ""], cwd=repo, env=_system_env(),
                               capture_output=True, text=True, timeout=540)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
        assert "creating the project virtual environment .venv (from /usr/bin/python3)" in first.stderr
        venv_python = repo / ".venv" / "bin" / "python"
        where = subprocess.run([str(venv_python), "-c", "import sys, rollstream; print(sys.prefix, rollstream.__file__)"],
                               cwd=base, capture_output=True, text=True, env=_system_env(), check=True).stdout.split()
        assert where == [str(repo / ".venv"), str(repo / "rollstream" / "__init__.py")]  # editable, in the venv
        assert (repo / ".venv" / "bin" / "rollstream").exists()
        site = next((repo / ".venv" / "lib").glob("python3*/site-packages"))
        before = sorted(p.name for p in site.iterdir())

        second = subprocess.run(["bash", "scripts/install", ""], cwd=repo, env=_system_env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr[-3000:]
        assert "install" not in second.stderr and not second.stdout, second.stderr
        assert sorted(p.name for p in site.iterdir()) == before
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_scripts_install_refuses_a_python_older_than_the_floor_with_one_line():
    old = next((p for p in ("/usr/bin/python3.9", "/usr/bin/python3.10") if Path(p).exists()), None)
    floor = subprocess.run([sys.executable, "-c", "import tomllib; print(tomllib.load(open('pyproject.toml', 'rb'))"
                            "['project']['requires-python'])"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert floor == ">=3.11"  # the floor scripts/install checks, and the README states
    assert "Python ≥ 3.11" in (ROOT / "README.md").read_text()
    if old is None:
        return  # no older interpreter on this machine to try; the floor is checked above
    result = subprocess.run(["bash", "scripts/install"], cwd=ROOT, env={**_system_env(), "PYTHON": old},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "needs Python >= 3.11" in result.stderr
