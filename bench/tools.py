"""Tool round trips into a bubblewrap sandbox, against tmux polling and subprocess.run.

Run: python bench/tools.py [--calls 300] [--live 64]. Prints a table, then a last line
`RESULT {json}` with bash_echo_p50_ms, bash_echo_p99_ms, tmux_echo_p50_ms,
subprocess_echo_p50_ms, ipython_p50_ms (and raw kernels': ipython_raw_kernel_p50_ms with ipykernel's
defaults, ipython_raw_tuned_kernel_p50_ms with the sandbox's KERNEL_ARGS),
sandbox_create_destroy_p50_ms, live_sandboxes. Where a Docker engine (podman here, from
scripts/install-podman) has the base image, also bash behind `docker exec -t`:
docker_bash_echo_p50_ms (the round trip), and with sessions driven in this process on the same
container, docker_session_reached_p50_ms (the container's pty reached from the host) against
docker_session_stty_per_prompt_p50_ms (the fallback, a `stty` in the container per prompt:
what every call paid before session 9), and their ratio.

A/B of the bash `echo` round trip between two commits, side by side in one run (a busy
machine changes speed from one minute to the next more than most changes do):

    python bench/tools.py --ab BASE_REV [--new REV_OR_DIR] [--pairs 30] [--window 100] [--in-process]

Each side runs its own code in its own process with its own sandbox; the two take turns
in windows of N calls, in alternating order. Last line: `RESULT {json}` with
``bash_echo_p50_ms_base``, ``bash_echo_p50_ms_new``, ``median_diff_ms`` (new - base, per
pair of windows), ``new_faster_pairs``, ``pairs``, ``load_average``. With ``--in-process`` each side drives a bash
session in its own process, without sandbox, socket or supervisor: the framing's own cost. With
``--instructions`` (needs valgrind and strace) it counts what bash does a call instead, the same on
a busy machine: ``bash_ir_per_call_*`` and ``bash_syscalls_per_call_*`` over ``--calls`` calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from rollstream.sandboxes import (
    SandboxClient,
    SandboxSpec,
    create_sandbox,
    destroy_sandbox,
)
from rollstream.sandboxes.backends.common import KERNEL_ARGS
from rollstream.sandboxes.backends.docker import DockerBackend
from rollstream.sandboxes.env_images import DEFAULT_BASE_IMAGE
from rollstream.sandboxes.runtime.bash_session import BashSession
from rollstream.sandboxes.runtime.bash_terminal import container_pid_namespace
from rollstream.sandboxes.supervisor_spawn import stop_fork_server


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def bench_sandbox_bash(sb: SandboxClient, command: str, calls: int) -> list[float]:
    for _ in range(20):  # warm up
        await sb.bash(command)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        result = await sb.bash(command)
        times.append((time.perf_counter() - started) * 1000)
        assert result.exit_code == 0, result
    return times


def bench_tmux(command: str, calls: int) -> list[float]:
    """The common baseline: tmux send-keys, then capture-pane every 10 ms until a marker shows."""
    if shutil.which("tmux") is None:
        return []
    session = f"bench-{uuid.uuid4().hex[:6]}"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", "bash --norc"], check=True)
    times = []
    try:
        for index in range(calls):
            marker = f"__done_{index}__"
            started = time.perf_counter()
            subprocess.run(["tmux", "send-keys", "-t", session, f"{command}; echo {marker}", "Enter"], check=True)
            while True:
                pane = subprocess.run(["tmux", "capture-pane", "-p", "-t", session],
                                      capture_output=True, text=True).stdout
                if any(line.strip() == marker for line in pane.splitlines()):
                    break
                time.sleep(0.01)
            times.append((time.perf_counter() - started) * 1000)
            subprocess.run(["tmux", "clear-history", "-t", session])
            subprocess.run(["tmux", "send-keys", "-t", session, "clear", "Enter"])
            time.sleep(0.005)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session])
    return times


def bench_subprocess(command: str, calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        subprocess.run(["bash", "-c", command], capture_output=True, check=True)
        times.append((time.perf_counter() - started) * 1000)
    return times


def bench_raw_kernel(calls: int, kernel_args: list[str]) -> list[float]:
    """The issue's baseline: a local kernel driven by jupyter_client's own client, no sandbox.

    Run with ipykernel's defaults (the baseline) and with the KERNEL_ARGS sandboxes use,
    so that the gap to the sandbox row is our socket, supervisor and bwrap, whatever
    the load on the machine.
    """
    import sys

    from jupyter_client import KernelManager

    folder = tempfile.mkdtemp(prefix="rsk-", dir="/tmp")
    manager = KernelManager(transport="ipc", ip=os.path.join(folder, "k"))
    manager.kernel_spec.argv = [sys.executable, *kernel_args]
    # IPython's on-disk history of the stock kernel goes where a sandbox's would.
    manager.kernel_spec.env = {"IPYTHONDIR": os.path.join(folder, "ipython")}
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    times = []
    try:
        client.wait_for_ready(timeout=60)
        for index in range(calls + 20):
            started = time.perf_counter()
            reply = client.execute_interactive("1+1", output_hook=lambda message: None, timeout=30)
            if index >= 20:  # warm-up
                times.append((time.perf_counter() - started) * 1000)
            assert reply["content"]["status"] == "ok", reply
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
        shutil.rmtree(folder, ignore_errors=True)
    return times


async def bench_create_destroy(root_dir: str, rounds: int) -> list[float]:
    times = []
    for index in range(rounds):
        started = time.perf_counter()
        handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"cd{index}", root_dir=root_dir)
        await destroy_sandbox(handle)
        times.append((time.perf_counter() - started) * 1000)
    return times


async def bench_live(root_dir: str, count: int) -> int:
    handles = []
    semaphore = asyncio.Semaphore(8)

    async def make(index: int):
        async with semaphore:
            return await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"live{index}", root_dir=root_dir)

    results = await asyncio.gather(*(make(i) for i in range(count)), return_exceptions=True)
    handles = [r for r in results if not isinstance(r, BaseException)]
    answering = 0
    try:
        async def check(handle):
            async with SandboxClient(handle.socket_path) as sb:
                return (await sb.bash(f"echo {handle.id}")).output.strip() == handle.id

        answering = sum(await asyncio.gather(*(check(h) for h in handles)))
    finally:
        await asyncio.gather(*(destroy_sandbox(h) for h in handles))
    return answering


def bench_session(session: BashSession, calls: int) -> list[float]:
    """`echo hi` through a bash session driven in this process."""
    for _ in range(20):
        session.run(b"echo hi", 30, None)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        result = session.run(b"echo hi", 30, None)
        times.append((time.perf_counter() - started) * 1000)
        assert result["output"] == b"hi\n", result
    return times


async def bench_docker(root_dir: str, calls: int) -> list[tuple[str, list[float]]]:
    """bash `echo hi` behind `docker exec -t` (podman here), where the container's pty is
    reached from the host, against the fallback that runs stty in the container before each
    prompt (what every call paid before): the same container, sessions driven in this
    process, then the whole round trip through the supervisor. Empty without an engine."""
    names = ("docker bash `echo hi`, session, container pty reached", "docker bash `echo hi`, session, stty per prompt",
             "docker bash `echo hi` (socket -> docker exec pty)")
    if not DockerBackend().available() or subprocess.run(
            ["docker", "image", "inspect", DEFAULT_BASE_IMAGE], capture_output=True).returncode != 0:
        return [(name, []) for name in names]
    handle = await create_sandbox(SandboxSpec(backend="docker", image=DEFAULT_BASE_IMAGE), sandbox_id="dk",
                                  root_dir=root_dir)
    rows = []
    try:
        with open(os.path.join(handle.dir, "plan.json")) as plan_file:
            plan = json.load(plan_file)
        namespace = container_pid_namespace(plan["inspect_argv"], plan["host_env"])
        for name, inside in zip(names, (namespace, None)):
            session = BashSession(plan["bash_argv"], plan["spawn_env"], plan["spawn_cwd"], {}, 1 << 20,
                                  inside_namespace=inside)
            session.start()
            try:
                rows.append((name, bench_session(session, calls)))
            finally:
                session.close()
        async with SandboxClient(handle.socket_path) as sb:
            rows.append((names[2], await bench_sandbox_bash(sb, "echo hi", calls)))
    finally:
        await destroy_sandbox(handle)
    return rows


# Runs in each A/B side's process, on that side's code: makes a sandbox, then reads a
# window size from stdin, runs that many `echo hi` calls and prints their median in ms.
AB_SIDE = r"""
import asyncio, shutil, statistics, sys, tempfile, time
from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
try:
    from rollstream.sandboxes.supervisor_spawn import stop_fork_server
except ImportError:  # a side older than the module's rename
    from rollstream.sandboxes.forkserver import stop_fork_server

async def main():
    root = tempfile.mkdtemp(prefix="rsab-", dir="/tmp")
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="ab", root_dir=root)
    try:
        async with SandboxClient(handle.socket_path) as sb:
            for _ in range(50):
                await sb.bash("echo hi")
            print("ready", flush=True)
            loop = asyncio.get_running_loop()
            while (line := await loop.run_in_executor(None, sys.stdin.readline)):
                times = []
                for _ in range(int(line)):
                    started = time.perf_counter()
                    result = await sb.bash("echo hi")
                    times.append((time.perf_counter() - started) * 1000)
                    assert result.output == "hi\n", result
                print(statistics.median(times), flush=True)
    finally:
        await destroy_sandbox(handle)
        await stop_fork_server(root)
        shutil.rmtree(root, ignore_errors=True)

asyncio.run(main())
"""


# The same, with the bash session driven in this process (no sandbox, no socket, no
# supervisor): the framing's own cost, less sensitive to the machine's load.
AB_SIDE_IN_PROCESS = r"""
import statistics, sys, time
from rollstream.sandboxes.runtime.bash_session import BashSession

session = BashSession(["bash", "--noediting", "--noprofile", "--norc", "-i"],
                      {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, "/tmp", {}, 1 << 20)
session.start()
for _ in range(50):
    session.run(b"echo hi", 30, None)
print("ready", flush=True)
for line in sys.stdin:
    times = []
    for _ in range(int(line)):
        started = time.perf_counter()
        result = session.run(b"echo hi", 30, None)
        times.append((time.perf_counter() - started) * 1000)
        assert result["output"] == b"hi\n", result
    print(statistics.median(times), flush=True)
session.close()
"""


# What bash itself does a call, counted rather than timed (the same on a busy machine): the
# session's bash under valgrind's callgrind (instructions) or strace -c (system calls), for
# 20 and for 20 + N calls of `echo hi`; the difference over N. Prints "Ir syscalls".
AB_SIDE_INSTRUCTIONS = r"""
import os, re, sys, tempfile
from rollstream.sandboxes.runtime.bash_session import BashSession

def total(tool, calls):
    out = tempfile.mktemp(prefix="rs-count-")
    prefix = (["valgrind", "--tool=callgrind", "--callgrind-out-file=" + out] if tool == "ir"
              else ["strace", "-f", "-c", "-o", out])
    session = BashSession([*prefix, "bash", "--noediting", "--noprofile", "--norc", "-i"],
                          {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, "/tmp", {}, 1 << 20)
    session.start()
    for _ in range(calls):
        assert session.run(b"echo hi", 60, None)["output"] == b"hi\n"
    session.run(b"exit 0", 60, None)  # a clean exit: the tool writes its counts
    session.close()
    text = open(out).read()
    os.unlink(out)
    if tool == "ir":
        return int(re.search(r"^(?:summary|totals): (\d+)", text, re.M).group(1))
    return int(re.search(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?total", text, re.M).group(1))

calls = int(sys.argv[1])
print(*[(total(tool, 20 + calls) - total(tool, 20)) / calls for tool in ("ir", "syscalls")], flush=True)
"""


def bash_instructions_ab(base: str, new: str, calls: int) -> None:
    """What bash does a call under each side's framing: instructions and system calls."""
    import sys

    from pipeline_ab import REPO, checkout  # bench/pipeline_ab.py, beside this file

    worktrees: list = []
    counts = {}
    try:
        for name, rev in (("base", base), ("new", new)):
            tree = checkout(rev, worktrees)
            done = subprocess.run([sys.executable, "-c", AB_SIDE_INSTRUCTIONS, str(calls)], cwd=tree, check=True,
                                  env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True)
            counts[name] = [float(value) for value in done.stdout.split()]
    finally:
        for where in worktrees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], capture_output=True)
    print(f"bash a call of `echo hi` ({calls} calls): instructions (callgrind Ir) and system calls (strace -c)")
    for name, rev in (("base", base), ("new", new)):
        print(f"{name:6} {rev:40} {counts[name][0]:10.0f} Ir {counts[name][1]:6.1f} syscalls")
    print("RESULT " + json.dumps({
        "bash_ir_per_call_base": round(counts["base"][0]), "bash_ir_per_call_new": round(counts["new"][0]),
        "bash_syscalls_per_call_base": counts["base"][1], "bash_syscalls_per_call_new": counts["new"][1],
    }))


def bash_ab(base: str, new: str, pairs: int, window: int, in_process: bool = False) -> None:
    """Bash `echo` p50 of two commits (or folders), alternating windows, one table."""
    import sys

    from pipeline_ab import REPO, checkout  # bench/pipeline_ab.py, beside this file

    worktrees: list = []
    sides = {}
    try:
        for name, rev in (("base", base), ("new", new)):
            tree = checkout(rev, worktrees)
            process = subprocess.Popen(
                [sys.executable, "-c", AB_SIDE_IN_PROCESS if in_process else AB_SIDE], cwd=tree,
                env={**os.environ, "PYTHONPATH": str(tree)},
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )
            assert process.stdout.readline().strip() == "ready", f"the {name} side did not start"
            sides[name] = process

        def window_p50(name: str) -> float:
            sides[name].stdin.write(f"{window}\n")
            sides[name].stdin.flush()
            return float(sides[name].stdout.readline())

        medians: dict[str, list[float]] = {"base": [], "new": []}
        for index in range(pairs):
            for name in ("base", "new") if index % 2 == 0 else ("new", "base"):
                medians[name].append(window_p50(name))
    finally:
        for process in sides.values():
            process.stdin.close()
            process.wait(timeout=60)
        for where in worktrees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], capture_output=True)
    diffs = [new_ms - base_ms for base_ms, new_ms in zip(medians["base"], medians["new"])]
    load = os.getloadavg()
    where = "in-process session (no sandbox)" if in_process else "round trip into a bwrap sandbox"
    print(f"bash `echo hi` {where}, {pairs} pairs of {window}-call windows; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'side':6} {'revision':40} {'p50 of window medians ms':>26}")
    for name, rev in (("base", base), ("new", new)):
        print(f"{name:6} {rev:40} {statistics.median(medians[name]):26.3f}")
    print(f"median per-pair difference (new - base): {statistics.median(diffs):+.3f} ms; "
          f"new faster in {sum(d < 0 for d in diffs)} of {pairs} pairs")
    print("RESULT " + json.dumps({
        "bash_echo_p50_ms_base": round(statistics.median(medians["base"]), 3),
        "bash_echo_p50_ms_new": round(statistics.median(medians["new"]), 3),
        "median_diff_ms": round(statistics.median(diffs), 3),
        "new_faster_pairs": sum(d < 0 for d in diffs),
        "pairs": pairs,
        "load_average": [round(value, 2) for value in load],
        "in_process": in_process,
    }))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ab", metavar="BASE_REV", help="compare bash echo with this commit (or folder) instead")
    parser.add_argument("--new", default=".",
                        help="with --ab: the other side, a commit or folder (default: this checkout)")
    parser.add_argument("--in-process", action="store_true",
                        help="with --ab: drive the bash session in this process, no sandbox")
    parser.add_argument("--instructions", action="store_true",
                        help="with --ab: count bash's instructions and system calls a call (valgrind, strace)")
    parser.add_argument("--pairs", type=int, default=30)
    parser.add_argument("--window", type=int, default=100)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--ipython-calls", type=int, default=200)
    parser.add_argument("--baseline-calls", type=int, default=100)
    parser.add_argument("--create-rounds", type=int, default=30)
    parser.add_argument("--live", type=int, default=64)
    args = parser.parse_args()
    if args.ab:
        new = str(Path(__file__).resolve().parent.parent) if args.new == "." else args.new
        if args.instructions:
            bash_instructions_ab(args.ab, new, args.calls)
        else:
            bash_ab(args.ab, new, args.pairs, args.window, args.in_process)
        return
    root_dir = tempfile.mkdtemp(prefix="rsb-", dir="/tmp")
    rows: list[tuple[str, list[float]]] = []
    try:
        handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="bench", root_dir=root_dir)
        try:
            async with SandboxClient(handle.socket_path) as sb:
                for command in ("true", "echo hi", "ls /"):
                    rows.append((f"sandbox bash `{command}` (socket -> bwrap pty)",
                                 await bench_sandbox_bash(sb, command, args.calls)))
                await sb.ipython("1+1")  # starts the kernel
                ipython = []
                for _ in range(args.ipython_calls):
                    started = time.perf_counter()
                    await sb.ipython("1+1")
                    ipython.append((time.perf_counter() - started) * 1000)
                rows.append(("sandbox ipython `1+1`", ipython))
        finally:
            await destroy_sandbox(handle)
        stock = ["-m", "ipykernel_launcher", "-f", "{connection_file}"]
        rows.append(("raw stock kernel `1+1` (jupyter_client, no sandbox)",
                     bench_raw_kernel(args.ipython_calls, stock)))
        rows.append(("raw kernel, sandbox KERNEL_ARGS `1+1`", bench_raw_kernel(args.ipython_calls, KERNEL_ARGS)))
        rows.append(("tmux send-keys + capture-pane/10 ms `echo hi`", bench_tmux("echo hi", args.baseline_calls)))
        rows.append(("subprocess.run bash -c `echo hi`", bench_subprocess("echo hi", args.baseline_calls)))
        rows.append(("bwrap sandbox create + destroy", await bench_create_destroy(root_dir, args.create_rounds)))
        rows += await bench_docker(root_dir, args.calls)
        live = await bench_live(root_dir, args.live)
    finally:
        await stop_fork_server(root_dir)  # started by the first create_sandbox in root_dir
        shutil.rmtree(root_dir, ignore_errors=True)

    print(f"{'measurement':55} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}")
    for name, values in rows:
        if values:
            print(f"{name:55} {len(values):5d} {percentile(values, .5):9.3f} {percentile(values, .99):9.3f} "
                  f"{statistics.mean(values):9.3f}")
        else:
            print(f"{name:55} {'-':>5} (not available)")
    print(f"live sandboxes answering at once: {live} of {args.live}")
    by_name = dict(rows)
    echo = by_name["sandbox bash `echo hi` (socket -> bwrap pty)"]
    tmux = by_name["tmux send-keys + capture-pane/10 ms `echo hi`"]
    result = {
        "bash_echo_p50_ms": round(percentile(echo, .5), 3),
        "bash_echo_p99_ms": round(percentile(echo, .99), 3),
        "bash_true_p50_ms": round(percentile(by_name["sandbox bash `true` (socket -> bwrap pty)"], .5), 3),
        "bash_ls_p50_ms": round(percentile(by_name["sandbox bash `ls /` (socket -> bwrap pty)"], .5), 3),
        "tmux_echo_p50_ms": round(percentile(tmux, .5), 3) if tmux else None,
        "subprocess_echo_p50_ms": round(percentile(by_name["subprocess.run bash -c `echo hi`"], .5), 3),
        "ipython_p50_ms": round(percentile(by_name["sandbox ipython `1+1`"], .5), 3),
        "ipython_raw_kernel_p50_ms": round(
            percentile(by_name["raw stock kernel `1+1` (jupyter_client, no sandbox)"], .5), 3),
        "ipython_raw_tuned_kernel_p50_ms": round(percentile(by_name["raw kernel, sandbox KERNEL_ARGS `1+1`"], .5), 3),
        "sandbox_create_destroy_p50_ms": round(percentile(by_name["bwrap sandbox create + destroy"], .5), 3),
        "live_sandboxes": live,
    }
    docker = [by_name[name] for name in by_name if name.startswith("docker bash")]
    if all(docker):
        reached, stty, round_trip = (round(percentile(values, .5), 3) for values in docker)
        result.update(docker_bash_echo_p50_ms=round_trip, docker_session_reached_p50_ms=reached,
                      docker_session_stty_per_prompt_p50_ms=stty, docker_stty_per_prompt_ratio=round(stty / reached, 1))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
