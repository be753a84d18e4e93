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


def _install_env() -> dict[str, str]:
    """The login's environment for scripts/install, with pip told not to byte-compile what it
    installs: a third of the install's CPU here, and nothing this test looks at (the venv, its
    interpreter, the editable rollstream, a second run that installs nothing). pip reads a
    ``--no-X`` switch's variable as the value of X itself: "0" is ``--no-compile``, "1" compiles."""
    return {**_system_env(), "PIP_NO_COMPILE": "0"}


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
        first = subprocess.run(["bash", "scripts/install", ""], cwd=repo, env=_install_env(),
                               capture_output=True, text=True, timeout=540)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
        assert "creating the project virtual environment .venv (from /usr/bin/python3)" in first.stderr
        venv_python = repo / ".venv" / "bin" / "python"
        where = subprocess.run(
            [str(venv_python), "-c", "import sys, rollstream; print(sys.prefix, rollstream.__file__)"],
            cwd=base, capture_output=True, text=True, env=_system_env(), check=True).stdout.split()
        assert where == [str(repo / ".venv"), str(repo / "rollstream" / "__init__.py")]  # editable, in the venv
        assert (repo / ".venv" / "bin" / "rollstream").exists()
        site = next((repo / ".venv" / "lib").glob("python3*/site-packages"))
        before = sorted(p.name for p in site.iterdir())

        second = subprocess.run(["bash", "scripts/install", ""], cwd=repo, env=_install_env(),
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


def _torch_source(extra_env: dict[str, str]) -> list[str]:
    """What scripts/install passes pip for torch, on a machine whose pip has no configuration."""
    env = {**_system_env(), "PIP_CONFIG_FILE": os.devnull, **extra_env}
    env.pop("PIP_FIND_LINKS", None)
    out = subprocess.run(["bash", "scripts/torch-source", sys.executable, "2.13.0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return out.split()


def test_a_local_torch_wheel_pip_is_not_configured_to_see_is_used_not_the_cuda_build(tmp_path):
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"")  # only its name is looked at; pip reads it at install time
    assert _torch_source({"ROLLSTREAM_LOCAL_WHEELS": str(tmp_path)}) == ["--find-links", str(tmp_path)]
    # Without one, a machine with no NVIDIA driver takes the CPU-only index, never PyPI's CUDA build.
    no_gpu_path = {"PATH": "/usr/bin:/bin"} if not Path("/usr/bin/nvidia-smi").exists() else {}
    if no_gpu_path:
        assert _torch_source({"ROLLSTREAM_LOCAL_WHEELS": str(tmp_path / "none"), **no_gpu_path}) == [
            "--index-url", "https://download.pytorch.org/whl/cpu"]


def test_the_venv_is_made_from_debians_python_whatever_is_first_on_path(tmp_path):
    """CI's PATH starts with another python3 (pyenv): the suite must still run on Debian's own."""
    if not SYSTEM_PYTHON.exists():
        pytest.fail("this check needs Debian's /usr/bin/python3 (a stock Debian 12)")
    shadow = tmp_path / "bin"
    shadow.mkdir()
    (shadow / "python3").symlink_to(sys.executable if Path(sys.executable).resolve() != SYSTEM_PYTHON.resolve()
                                    else "/bin/false")
    env = {**_system_env(), "PATH": f"{shadow}:/usr/bin:/bin"}
    env.pop("PYTHON", None)
    chosen = subprocess.run(["bash", "scripts/python-for-venv"], cwd=ROOT, env=env, capture_output=True,
                            text=True, check=True).stdout.strip()
    assert chosen == "/usr/bin/python3"
    assert subprocess.run(["bash", "scripts/python-for-venv"], cwd=ROOT, env={**env, "PYTHON": "/x/python3.12"},
                          capture_output=True, text=True, check=True).stdout.strip() == "/x/python3.12"


def test_the_suite_runs_on_the_interpreter_the_readme_names():
    """scripts/test runs pytest in .venv, made from scripts/python-for-venv's choice: on Debian 12
    that is /usr/bin/python3 (3.11.2), so CI tests what the README promises."""
    expected = subprocess.run(["bash", "scripts/python-for-venv"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    expected_path = shutil.which(expected) or expected
    base = getattr(sys, "_base_executable", sys.executable)
    assert os.path.realpath(base) == os.path.realpath(expected_path), (base, expected_path)
