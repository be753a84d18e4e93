"""How many bwrap sandboxes with every tool live fit on this node (issue #33 item 7).

Run: python bench/density.py [--counts 64,128,256,512] [--harness python|node|none]

Sandboxes are added step by step up to each count. Each holds a bash session, a harness
process started from it (default: a sleeping `python3 -c` inside the sandbox) and an IPython
kernel, started by a first cell (eight at a time, as a warm pool would; --kernels-at-once). At each count a cell
runs in every sandbox at once, twice (the second round after all answered the first), and the
sandboxes' memory is read: PSS summed over each sandbox's processes (rollstream/sandboxes/
capacity.py, what the warm pool sizes itself by) and the node's used-memory delta
(MemTotal - MemAvailable against before the first sandbox; other work on the node moves it).
A step that gets MemAvailable down to --floor-gib stops growing there: the sandboxes whose
kernels had started are measured as the step's row (`live` of its count: how many fit), the
others destroyed, and no larger step is tried (--no-fill: a step that would not fit by the last
row's figure is not started). Prints a table, then a last line
`RESULT {json}` with sandboxes_live_with_kernels (the most live sandboxes with every kernel
answering), live ({count: sandboxes live at that step}), mb_per_sandbox_with_kernel and
node_mb_per_sandbox ({count: MB}),
cell_p50_ms and cell_p99_ms ({count: ms} of the all-at-once rounds), create_p50_ms,
kernel_start_p50_ms, bash_only_mb_per_sandbox (the same sandboxes before their kernels
started), fork_server_mb (shared by all, outside the per-sandbox figures).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from tools import percentile  # bench/tools.py, beside this file

from rollstream.sandboxes import (
    SandboxClient,
    SandboxError,
    SandboxSpec,
    create_sandbox,
    destroy_sandbox,
)
from rollstream.sandboxes.capacity import (
    mem_available_mb,
    process_trees,
    pss_kb,
    sandboxes_pss_mb,
)
from rollstream.sandboxes.supervisor_spawn import server_pid, stop_fork_server

HARNESSES = {
    "python": "python3 -c 'import time; time.sleep(10**7)'",
    "node": "node -e 'setTimeout(() => {}, 1e10)'",
    "none": "",
}


def node_used_mb() -> float:
    with open("/proc/meminfo") as handle:
        total = int(next(line for line in handle if line.startswith("MemTotal:")).split()[1]) / 1024.0
    return total - mem_available_mb()


class Fleet:
    """The live sandboxes, their supervisors' pids and the timings of their start."""

    def __init__(self, root_dir: str, harness: str, floor_mb: float, kernels_at_once: int) -> None:
        self.kernels_at_once = kernels_at_once
        self.root_dir = root_dir
        self.harness = harness
        self.floor_mb = floor_mb
        self.handles: list = []
        self.supervisors: list[int] = []
        self.create_ms: list[float] = []
        self.kernel_start_ms: list[float] = []
        self.stopped = ""  # why the fleet stopped growing
        self.errors: list[str] = []  # what the cells that failed said
        self.kernel_less: list = []  # sandboxes left without a kernel when the floor was reached

    def low_memory(self) -> bool:
        available = mem_available_mb()
        if available < self.floor_mb:
            self.stopped = f"MemAvailable {available / 1024:.1f} GiB < floor {self.floor_mb / 1024:.1f} GiB"
            return True
        return False

    async def grow(self, count: int) -> tuple[list, list[float]]:
        """Start sandboxes (bash + harness) up to `count`; their pss before kernels start."""
        semaphore = asyncio.Semaphore(8)

        async def make(index: int):
            async with semaphore:
                if self.stopped or self.low_memory():
                    return None
                started = time.perf_counter()
                handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"d{index}",
                                              root_dir=self.root_dir)
                self.create_ms.append((time.perf_counter() - started) * 1000)
                self.handles.append(handle)
                if self.harness:
                    async with SandboxClient(handle.socket_path) as sb:
                        await sb.bash(f"( setsid {self.harness} </dev/null >/dev/null 2>&1 & )")
                self.supervisors.append(handle.supervisor_pid)
                return handle, handle.supervisor_pid

        made = await asyncio.gather(*(make(i) for i in range(len(self.handles), count)))
        fresh = [item for item in made if item is not None]
        bash_only = sandboxes_pss_mb([pid for _, pid in fresh])
        return fresh, list(bash_only.values())

    async def start_kernels(self, fresh: list, at_once: int) -> int:
        """The first cell of each new sandbox (it starts the kernel), `at_once` at a time; those
        not started (the floor was reached first) are kept in `kernel_less`."""
        semaphore = asyncio.Semaphore(at_once)

        async def first_cell(handle) -> bool:
            async with semaphore:
                if self.stopped or self.low_memory():
                    self.kernel_less.append(handle)
                    return False
                started = time.perf_counter()
                try:
                    async with SandboxClient(handle.socket_path) as sb:
                        result = await sb.ipython("1+1", timeout_s=300)
                except SandboxError as error:  # a kernel that did not start: counted, and said why
                    self.errors.append(str(error))
                    return False
                self.kernel_start_ms.append((time.perf_counter() - started) * 1000)
                return result.result == "2"

        return sum(await asyncio.gather(*(first_cell(handle) for handle, _ in fresh)))

    async def all_at_once(self) -> tuple[int, list[float]]:
        """A cell in every sandbox at once: how many answered right, and each one's latency."""
        clients = [SandboxClient(handle.socket_path) for handle in self.handles]
        await asyncio.gather(*(client.connect() for client in clients))
        try:
            async def cell(index: int, client: SandboxClient) -> tuple[bool, float]:
                started = time.perf_counter()
                try:
                    result = await client.ipython(f"{index} * 2", timeout_s=300)
                except SandboxError as error:
                    self.errors.append(str(error))
                    return False, (time.perf_counter() - started) * 1000
                return result.result == str(index * 2), (time.perf_counter() - started) * 1000

            answers = await asyncio.gather(*(cell(i, c) for i, c in enumerate(clients)))
        finally:
            await asyncio.gather(*(client.close() for client in clients))
        return sum(ok for ok, _ in answers), [ms for _, ms in answers]

    def breakdown(self) -> tuple[int, dict[str, float]]:
        """Sandboxes whose harness still runs, and the mean MB of PSS a sandbox by process role."""
        marker = self.harness.split()[-1].strip("'").encode() if self.harness else None
        alive = 0 if marker else len(self.supervisors)
        by_role: dict[str, float] = {}
        for root, tree in process_trees(self.supervisors).items():
            for pid in tree:
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as handle:
                        argv = handle.read()
                except OSError:
                    continue
                if pid == root:
                    role = "supervisor"
                elif marker and marker in argv:
                    role = "harness"
                    alive += 1
                elif b"ipykernel" in argv and not argv.startswith(b"/usr/bin/bwrap"):
                    role = "kernel"
                else:
                    role = argv.split(b"\0")[0].rsplit(b"/", 1)[-1].decode(errors="replace")
                by_role[role] = by_role.get(role, 0.0) + pss_kb(pid) / 1024.0 / len(self.supervisors)
        return alive, by_role

    async def destroy(self, handles: list | None = None) -> None:
        """Destroy `handles` (default: all) and forget them."""
        handles = list(self.handles if handles is None else handles)
        semaphore = asyncio.Semaphore(16)

        async def one(handle) -> None:
            async with semaphore:
                await destroy_sandbox(handle)

        await asyncio.gather(*(one(handle) for handle in handles), return_exceptions=True)
        gone = {id(handle) for handle in handles}
        self.handles = [handle for handle in self.handles if id(handle) not in gone]
        self.supervisors = [handle.supervisor_pid for handle in self.handles]


async def run(counts: list[int], harness: str, floor_mb: float, kernels_at_once: int, fill: bool) -> dict:
    root_dir = tempfile.mkdtemp(prefix="rsd-", dir="/tmp")
    fleet = Fleet(root_dir, HARNESSES[harness], floor_mb, kernels_at_once)
    rows = []
    bash_only: list[float] = []
    used_before = node_used_mb()
    fork_server_mb = 0.0
    kernels_ok = 0  # sandboxes whose first cell (their kernel's start) answered, all steps so far
    try:
        for count in counts:
            per_sandbox = rows[-1]["pss_mb"] if rows else 40.0
            need_mb = (count - len(fleet.handles)) * per_sandbox
            if mem_available_mb() - need_mb < floor_mb and not fill:
                fleet.stopped = (f"{count} needs ~{need_mb / 1024:.1f} GiB more at {per_sandbox:.1f} MB each; "
                                 f"MemAvailable is {mem_available_mb() / 1024:.1f} GiB, "
                                 f"floor {floor_mb / 1024:.1f} GiB")
            if fleet.stopped:
                rows.append({"count": count, "skipped": fleet.stopped})
                break
            grow_started = time.perf_counter()
            fresh, fresh_bash_only = await fleet.grow(count)
            bash_only += fresh_bash_only
            kernels_ok += await fleet.start_kernels(fresh, fleet.kernels_at_once)
            up_s = time.perf_counter() - grow_started
            if fleet.stopped and not fill:
                rows.append({"count": count, "skipped": fleet.stopped, "reached": len(fleet.handles)})
                break
            if fleet.kernel_less:  # the floor came before their kernels: only sandboxes with one count
                await fleet.destroy(fleet.kernel_less)
                fleet.kernel_less.clear()
            first_ok, first_ms = await fleet.all_at_once()
            second_ok, second_ms = await fleet.all_at_once()
            pss = sandboxes_pss_mb(fleet.supervisors)
            harnesses, by_role = fleet.breakdown()
            fork_server_mb = pss_kb(server_pid(root_dir) or 0) / 1024.0
            live = len(fleet.handles)
            rows.append({
                "count": count, "live": live, "kernels_started": kernels_ok,
                "answered": min(first_ok, second_ok), "harnesses": harnesses, "by_role": by_role,
                "pss_mb": statistics.mean(pss.values()), "pss_max_mb": max(pss.values()),
                "node_mb": (node_used_mb() - used_before) / live,
                "create_p50_ms": percentile(fleet.create_ms, .5),
                "kernel_p50_ms": percentile(fleet.kernel_start_ms, .5),
                "cell_p50_ms": percentile(second_ms, .5), "cell_p99_ms": percentile(first_ms + second_ms, .99),
                "up_s": up_s, "available_gib": mem_available_mb() / 1024, "stopped": fleet.stopped,
            })
            print(f"  {count}: {live} live, {rows[-1]['answered']} answering, {rows[-1]['pss_mb']:.1f} MB PSS each, "
                  f"MemAvailable {rows[-1]['available_gib']:.1f} GiB", file=sys.stderr, flush=True)
            if fleet.stopped:  # filled up to the floor: what fits is measured, nothing more is tried
                break
    finally:
        await fleet.destroy()
        await stop_fork_server(root_dir)
        shutil.rmtree(root_dir, ignore_errors=True)

    print(f"bwrap sandboxes, each with bash, an IPython kernel and a harness ({harness}: "
          f"{HARNESSES[harness] or 'none'}); load average {os.getloadavg()[0]:.1f}")
    print(f"{'sandboxes':>9} {'live':>5} {'1st cell':>8} {'answering':>9} {'harness':>7} {'PSS MB/sb':>9} {'max':>6} "
          f"{'node MB/sb':>10} "
          f"{'create p50':>10} {'kernel p50':>10} {'cell p50':>9} {'cell p99':>9} {'avail GiB':>9}")
    for row in rows:
        if "skipped" in row:
            print(f"{row['count']:9d} not run: {row['skipped']}")
            continue
        print(f"{row['count']:9d} {row['live']:5d} {row['kernels_started']:8d} {row['answered']:9d} "
              f"{row['harnesses']:7d} {row['pss_mb']:9.1f} {row['pss_max_mb']:6.1f} "
              f"{row['node_mb']:10.1f} {row['create_p50_ms']:8.0f}ms {row['kernel_p50_ms']:8.0f}ms "
              f"{row['cell_p50_ms']:7.1f}ms {row['cell_p99_ms']:7.1f}ms {row['available_gib']:9.1f}")
    done = [row for row in rows if "skipped" not in row]
    full = [row for row in done if row["answered"] == row["live"]]
    for row in done:
        if row["stopped"]:
            print(f"{row['count']}: {row['live']} fit with kernels live ({row['stopped']})")
    if done:
        roles = done[-1]["by_role"]
        print(f"where a sandbox's PSS goes at {done[-1]['count']}: " + ", ".join(
            f"{role} {mb:.1f} MB" for role, mb in sorted(roles.items(), key=lambda item: -item[1])))
    if fleet.errors:
        print(f"{len(fleet.errors)} cells failed, e.g.: {fleet.errors[0][:300]}")
    if bash_only:
        print(f"before their kernels started (bash + harness): {statistics.mean(bash_only):.1f} MB PSS a sandbox; "
              f"fork server (shared): {fork_server_mb:.1f} MB")
    return {
        "sandboxes_live_with_kernels": max((row["live"] for row in full), default=0),
        "live": {row["count"]: row["live"] for row in done},
        "mb_per_sandbox_with_kernel": {row["count"]: round(row["pss_mb"], 1) for row in done},
        "node_mb_per_sandbox": {row["count"]: round(row["node_mb"], 1) for row in done},
        "cell_p50_ms": {row["count"]: round(row["cell_p50_ms"], 1) for row in done},
        "cell_p99_ms": {row["count"]: round(row["cell_p99_ms"], 1) for row in done},
        "create_p50_ms": {row["count"]: round(row["create_p50_ms"], 1) for row in done},
        "kernel_start_p50_ms": {row["count"]: round(row["kernel_p50_ms"], 1) for row in done},
        "mb_by_process": {role: round(mb, 2) for role, mb in done[-1]["by_role"].items()} if done else {},
        "bash_only_mb_per_sandbox": round(statistics.mean(bash_only), 1) if bash_only else None,
        "fork_server_mb": round(fork_server_mb, 1),
        "harness": harness,
        "kernels_at_once": kernels_at_once,
        "cell_errors": len(fleet.errors),
        "first_cell_ok": {row["count"]: row["kernels_started"] for row in done},
        "not_run": [row["skipped"] for row in rows if "skipped" in row],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="64,128,256,512", help="sandbox counts, ascending")
    parser.add_argument("--harness", choices=sorted(HARNESSES), default="python")
    parser.add_argument("--floor-gib", type=float, default=3.0,
                        help="stop before MemAvailable would fall below this (the node is shared)")
    parser.add_argument("--no-fill", dest="fill", action="store_false",
                        help="skip a count that would not fit instead of filling the node up to the floor")
    parser.add_argument("--kernels-at-once", type=int, default=8,
                        help="kernels started at the same time by first cells (a warm pool starts a few at once)")
    args = parser.parse_args()
    counts = sorted(int(value) for value in args.counts.split(","))
    result = asyncio.run(run(counts, args.harness, args.floor_gib * 1024, args.kernels_at_once, args.fill))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
