"""The benchmarks a GPU node runs first (bench/trainer.py, bench/scaling.py) say what is missing
and exit 2 before starting anything, instead of exiting silently or failing minutes later: run
here by a Python with nothing installed (a bare venv), as a node without the wheels would be."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    return venv / "bin" / "python"


@pytest.mark.parametrize(("script", "missing"), [("bench/trainer.py", "torch, transformers, safetensors"),
                                                 ("bench/scaling.py", "psutil, redis")])
def test_a_benchmark_without_its_packages_says_which_and_how_to_carry_them(bare_python, script, missing):
    out = subprocess.run([str(bare_python), script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"{script} cannot run on this machine" in out.stderr
    assert f"Python modules missing for {bare_python}: {missing}" in out.stderr
    assert "--no-index --find-links wheels" in out.stderr and "Traceback" not in out.stderr


def test_the_machine_line_names_python_cpus_torch_and_the_tools(bare_python):
    code = "import sys; sys.path.insert(0, 'bench'); import machine; print(machine.describe())"
    line = subprocess.run([str(bare_python), "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=True).stdout
    assert f"Python {sys.version.split()[0]}" in line and "CPUs" in line and "no torch" in line
    assert "redis-server" in line and "bwrap" in line
