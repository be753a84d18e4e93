"""How many sandboxes this node can hold: memory available over what one sandbox costs.

A sandbox's cost is the proportional set size (PSS) of its processes summed (supervisor, bash,
IPython kernel, whatever runs inside), read from /proc/PID/smaps_rollup: pages shared between
sandboxes (the interpreter, libraries, what the fork server preloaded) count once over all of
them. The figure per kind is measured on live sandboxes (`observe`), else configured
(`ROLLSTREAM_SANDBOX_MB_<KIND>`), else the default that bench/density.py measured here.
The warm pool sizes itself by `node_capacity`, at what the node's job sandboxes measure (never
below the figure with a kernel); bench/density.py reports the same figures.
"""

from __future__ import annotations

import os
import threading

from .runtime.env_settings import env_name, env_setting

# MB a sandbox costs on a 2-core 24 GiB node (bwrap, host rootfs), rounded up: bash alone (tools.py's
# live sandboxes); bash + a live IPython kernel + a sleeping python3 harness, 37.6 MB of PSS and
# ~1.4 MB of kernel memory in its cgroup at 64 to 256 sandboxes (bench/density.py, bench/README.md).
DEFAULT_SANDBOX_MB = {"bash": 7.0, "kernel": 40.0}
# Memory left for everything else (workers, Redis, the tools' own growth): never planned away.
DEFAULT_RESERVE_MB = 3072.0

_measured: dict[str, float] = {}
_measured_lock = threading.Lock()


def mem_available_mb(meminfo: str = "/proc/meminfo") -> float:
    """The kernel's estimate of memory that new work can take without swapping (MemAvailable)."""
    with open(meminfo) as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{meminfo} has no MemAvailable line; a Linux kernel of 3.14 or later reports it")


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # exited while we listed
        children.setdefault(parent, []).append(int(name))
    return children


def process_trees(roots: list[int]) -> dict[int, list[int]]:
    """Each root pid with its descendants (one scan of /proc for all roots)."""
    children = _children_by_parent()
    trees = {}
    for root in roots:
        tree, stack = [], [root]
        while stack:
            pid = stack.pop()
            tree.append(pid)
            stack.extend(children.get(pid, []))
        trees[root] = tree
    return trees


def pss_kb(pid: int) -> int:
    """PSS of one process in kB; 0 for one that is gone (or not ours to read)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def sandboxes_pss_mb(supervisor_pids: list[int]) -> dict[int, float]:
    """MB of PSS of each sandbox, by its supervisor's pid: the supervisor and all it started."""
    trees = process_trees(supervisor_pids)
    return {root: sum(pss_kb(pid) for pid in tree) / 1024.0 for root, tree in trees.items()}


def observe(kind: str, supervisor_pids: list[int]) -> float:
    """Measure live sandboxes of `kind` (their supervisors' pids) and remember their mean cost.

    Call it with sandboxes in the state the pool keeps them in (for "kernel", after a cell
    ran): later `node_capacity(kind)` calls use the largest mean seen, never less.
    """
    sizes = [size for size in sandboxes_pss_mb(supervisor_pids).values() if size > 0]
    if not sizes:
        raise ValueError("none of these supervisors is alive (or readable): nothing to measure")
    mean = sum(sizes) / len(sizes)
    with _measured_lock:
        _measured[kind] = max(mean, _measured.get(kind, 0.0))
    return mean


def measured_mb(kind: str) -> float | None:
    """The largest mean `observe` saw for `kind` in this process, or None before any."""
    with _measured_lock:
        return _measured.get(kind)


def sandbox_mb(kind: str) -> float:
    """What one sandbox of `kind` costs: measured here, else configured, else the default."""
    with _measured_lock:
        if kind in _measured:
            return _measured[kind]
    variable = f"SANDBOX_MB_{kind.upper()}"
    configured = env_setting(variable)
    if configured:
        try:
            value = float(configured)
        except ValueError:
            value = 0.0
        if value <= 0:
            raise ValueError(f"{env_name(variable)}={configured!r}: give the MB one sandbox costs, e.g. 40")
        return value
    if kind not in DEFAULT_SANDBOX_MB:
        raise ValueError(
            f"no memory figure for sandbox kind {kind!r}: measure one with observe(), set "
            f"{env_name(variable)}, or use one of {sorted(DEFAULT_SANDBOX_MB)}"
        )
    return DEFAULT_SANDBOX_MB[kind]


def node_capacity(
    kind: str = "kernel",
    live_sandboxes: int = 0,
    reserve_mb: float = DEFAULT_RESERVE_MB,
    available_mb: float | None = None,
    per_sandbox_mb: float | None = None,
) -> int:
    """How many sandboxes of `kind` this node can hold now, the `live_sandboxes` it holds included.

    Live sandboxes already took their memory out of MemAvailable (read now unless the caller
    passes `available_mb`); the rest, less `reserve_mb`, is divided by what one more sandbox
    costs (`per_sandbox_mb`, by default `sandbox_mb(kind)`). A warm pool caps its size at
    `node_capacity(kind, live) - live`, the sandboxes that can still be started.
    """
    headroom_mb = (mem_available_mb() if available_mb is None else available_mb) - reserve_mb
    return live_sandboxes + max(0, int(headroom_mb // (per_sandbox_mb or sandbox_mb(kind))))
