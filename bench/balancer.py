"""Backend balancer benchmark (issue #7): prefix-cache reuse and load spread of three
routing policies on simulated LLM backends, plus the Lua acquire+release throughput.

Simulation: N backends, each an LRU prefix cache over token-id blocks (like vLLM's
automatic prefix caching) serving requests whose duration grows with uncached prompt
tokens, generated tokens and the backend's batch. Groups of G jobs share one prompt and run
multi-turn episodes (generate, tool call, observation, ...). A closed loop keeps a fixed
number of groups in flight, as a trainer does. Policies:
  (a) rollstream's Lua balancer, driven for real through Redis (acquire/release per turn);
  (b) ProRL Agent-style min-heap over a per-backend counter that only grows (each request
      goes to the backend with the fewest assignments so far; nothing is given back);
  (c) SkyRL / vllm-router `sticky_least_loaded`: a job's first request goes to the backend
      with the fewest requests in flight, later turns stick to it; no group affinity.
All three see the same workload (same seed). Run: python bench/balancer.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from redis.asyncio import Redis  # noqa: E402

from rollstream.llm.balancer import Balancer  # noqa: E402

BLOCK = 16  # tokens per KV block, vLLM's default


@dataclass
class Workload:
    # A multi-node RL deployment: 32 inference servers (4 nodes x 8 GPUs), 64 groups of 8
    # jobs in flight (512 concurrent episodes, 16 per server).
    backends: int = 32
    group_size: int = 8
    groups: int = 320
    groups_in_flight: int = 64
    # KV tokens per backend left for prefix caching (an 8B model on one 80 GB GPU: ~300k).
    cache_tokens: int = 300_000
    prompt_tokens: tuple[int, int] = (1500, 4000)
    turns: tuple[int, int] = (3, 10)
    gen_tokens: tuple[int, int] = (50, 400)
    obs_tokens: tuple[int, int] = (50, 800)
    tool_s_mean: float = 2.0
    seed: int = 0


class PrefixCache:
    """LRU over KV blocks. Block ids stand for chained block hashes: a block hits only if
    every block before it hits, as in vLLM's automatic prefix caching."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_blocks = capacity_tokens // BLOCK
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def lookup_and_insert(self, blocks: list[int]) -> int:
        """Tokens of the prompt already cached; then the whole prompt is cached (LRU)."""
        hit = 0
        for b in blocks:
            if b in self.blocks:
                hit += 1
            else:
                break
        for b in blocks:
            self.blocks[b] = None
            self.blocks.move_to_end(b)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)
        return hit * BLOCK


class Sequence:
    """A token sequence as full KV blocks plus a partial tail; new tokens are random, so
    each new full block is unique to its sequence (fresh id) while shared prefixes share ids."""

    _next_id = 0

    def __init__(self, blocks: list[int] | None = None, tail: int = 0) -> None:
        self.blocks = list(blocks or [])
        self.tail = tail

    @classmethod
    def fresh_id(cls) -> int:
        cls._next_id += 1
        return cls._next_id

    def extend(self, tokens: int) -> None:
        total = self.tail + tokens
        self.blocks.extend(self.fresh_id() for _ in range(total // BLOCK))
        self.tail = total % BLOCK

    def copy(self) -> Sequence:
        return Sequence(self.blocks, self.tail)

    def __len__(self) -> int:
        return len(self.blocks) * BLOCK + self.tail


@dataclass
class Job:
    job_id: str
    group_id: str
    seq: Sequence
    turns_left: int
    rng: random.Random
    backend: str | None = None
    lease: object | None = None


@dataclass
class Stats:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    requests: int = 0
    depth_samples: list[int] = field(default_factory=list)
    imbalance_samples: list[int] = field(default_factory=list)


# -- policies: choose(job) -> backend, done(job) after each request ----------------------


class LuaPolicy:
    name = "rollstream (Lua, group affinity)"

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer

    async def choose(self, job: Job, load: dict[str, int]) -> str:
        job.lease = await self.balancer.acquire(job.job_id, job.group_id)
        return job.lease.backend

    async def done(self, job: Job, finished: bool) -> None:
        await self.balancer.release(job.lease)
        if finished:
            await self.balancer.forget_job(job.job_id)


class CounterPolicy:
    name = "counter that only grows (ProRL)"

    def __init__(self, urls: list[str]) -> None:
        self.heap = [(0, url) for url in urls]

    async def choose(self, job: Job, load: dict[str, int]) -> str:
        count, url = heapq.heappop(self.heap)
        heapq.heappush(self.heap, (count + 1, url))
        return url

    async def done(self, job: Job, finished: bool) -> None:
        pass


class StickyLeastLoadedPolicy:
    name = "sticky least-loaded (SkyRL)"

    def __init__(self) -> None:
        self.sticky: dict[str, str] = {}

    async def choose(self, job: Job, load: dict[str, int]) -> str:
        if job.job_id not in self.sticky:
            self.sticky[job.job_id] = min(load, key=lambda url: (load[url], url))
        return self.sticky[job.job_id]

    async def done(self, job: Job, finished: bool) -> None:
        if finished:
            self.sticky.pop(job.job_id, None)


# -- discrete-event simulation in virtual time -------------------------------------------


def service_s(uncached: int, generated: int, batch: int) -> float:
    # Prefill ~ 20k tok/s, decode ~ 40 tok/s per sequence slowing as the batch grows.
    return uncached / 20_000 + generated / 40 * (1 + batch / 32)


async def simulate(policy, urls: list[str], w: Workload) -> Stats:
    rng = random.Random(w.seed)
    caches = {url: PrefixCache(w.cache_tokens) for url in urls}
    load = {url: 0 for url in urls}
    stats = Stats()
    events: list[tuple[float, int, str, Job]] = []
    seq = 0
    next_group = 0
    active_groups: dict[str, int] = {}

    def push(t: float, kind: str, job: Job) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, job))

    def start_group(t: float) -> None:
        nonlocal next_group
        gid = f"g{next_group}"
        next_group += 1
        prompt = Sequence()
        prompt.extend(rng.randint(*w.prompt_tokens))
        active_groups[gid] = w.group_size
        for j in range(w.group_size):
            job_rng = random.Random(rng.random())
            job = Job(f"{gid}-j{j}", gid, prompt.copy(), job_rng.randint(*w.turns), job_rng)
            push(t + job_rng.uniform(0, 1.0), "request", job)  # sandboxes get ready apart

    for _ in range(w.groups_in_flight):
        start_group(0.0)

    while events:
        t, _, kind, job = heapq.heappop(events)
        if kind == "request":
            backend = await policy.choose(job, load)
            job.backend = backend
            load[backend] += 1
            hit = caches[backend].lookup_and_insert(job.seq.blocks)
            prompt_len = len(job.seq)
            stats.prompt_tokens += prompt_len
            stats.hit_tokens += hit
            stats.requests += 1
            stats.depth_samples.extend(load.values())
            stats.imbalance_samples.append(max(load.values()) - min(load.values()))
            generated = job.rng.randint(*w.gen_tokens)
            job.seq.extend(generated)
            push(t + service_s(prompt_len - hit, generated, load[backend]), "done", job)
        else:
            load[job.backend] -= 1
            job.turns_left -= 1
            finished = job.turns_left == 0
            await policy.done(job, finished)
            caches[job.backend].lookup_and_insert(job.seq.blocks)
            if not finished:
                job.seq.extend(job.rng.randint(*w.obs_tokens))
                push(t + job.rng.expovariate(1 / w.tool_s_mean), "request", job)
            else:
                active_groups[job.group_id] -= 1
                if active_groups[job.group_id] == 0 and next_group < w.groups:
                    start_group(t)
    assert all(v == 0 for v in load.values())
    return stats


def p99(samples: list[int]) -> float:
    return float(statistics.quantiles(samples, n=100)[98]) if len(samples) > 1 else 0.0


# -- Lua throughput -----------------------------------------------------------------------


async def _throughput_clients(url: str, first: int, clients: int, seconds: float, barrier) -> int:
    redises = [Redis.from_url(url) for _ in range(clients)]
    balancers = [Balancer(r, namespace="thr", worker_id=f"w{first + i}") for i, r in enumerate(redises)]
    for r in redises:
        await r.ping()  # connect before the clock starts
    if barrier is not None:
        barrier.wait()
    deadline = time.perf_counter() + seconds

    async def loop(b: Balancer, i: int) -> int:
        n = 0
        while time.perf_counter() < deadline:
            lease = await b.acquire(f"job{i}-{n}", f"group{i}-{n // 8}")
            await b.release(lease)
            n += 1
        return n

    counts = await asyncio.gather(*(loop(b, first + i) for i, b in enumerate(balancers)))
    for r in redises:
        await r.aclose()
    return sum(counts)


def _throughput_process(url: str, first: int, clients: int, seconds: float, barrier, out) -> None:
    out.put(asyncio.run(_throughput_clients(url, first, clients, seconds, barrier)))


async def lua_throughput(url: str, clients: int, processes: int, seconds: float) -> tuple[float, float]:
    """Acquire+release pairs/s of `clients` concurrent connections spread over processes,
    and the pairs/s Redis itself could serve (1 / its EVALSHA time per pair): on a small
    machine the Python clients, not the Lua scripts, are the bottleneck.
    All processes connect first and start together, so start-up is not measured."""
    import multiprocessing as mp

    redis = Redis.from_url(url)
    balancer = Balancer(redis, namespace="thr")
    for i in range(8):
        await balancer.register(f"http://backend{i}:8000")
    ctx = mp.get_context("spawn")
    out, barrier = ctx.Queue(), ctx.Barrier(processes)
    per = [clients // processes + (i < clients % processes) for i in range(processes)]
    procs = [
        ctx.Process(target=_throughput_process, args=(url, sum(per[:i]), n, seconds, barrier, out))
        for i, n in enumerate(per)
    ]
    before = await _evalsha_usec(redis)
    for proc in procs:
        proc.start()
    total = sum(out.get() for _ in procs)
    for proc in procs:
        proc.join()
    server_usec = await _evalsha_usec(redis) - before
    assert set((await balancer.in_flight()).values()) == {0}, "throughput run leaked slots"
    await redis.aclose()
    return total / seconds, total / (server_usec / 1e6)


async def _evalsha_usec(redis: Redis) -> float:
    """Microseconds Redis spent in EVALSHA so far: the Lua scripts' own cost."""
    stats = await redis.info("commandstats")
    return float(stats.get("cmdstat_evalsha", {}).get("usec", 0))


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: apt-get install redis-server")
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        [binary, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        if sock.exists():
            break
        time.sleep(0.05)
    return proc, f"unix://{sock}"


WORKLOADS = {
    # Tool-use / coding tasks: long shared prompt (system + tools + task), a few turns.
    "tool-use": dict(prompt_tokens=(2000, 6000), turns=(1, 6), obs_tokens=(50, 500), groups_scale=1.0),
    # SWE-style: many turns with long observations; the job's own history dominates.
    # (fewer groups: each runs ~4x the requests, and the result is steady well before)
    "long-horizon": dict(
        prompt_tokens=(3000, 8000), turns=(5, 20), obs_tokens=(100, 2000), groups_scale=0.4
    ),
}


def workload(common: dict, shape: dict) -> Workload:
    shape = dict(shape)
    scale = shape.pop("groups_scale")
    groups = max(int(common["groups"] * scale), common["groups_in_flight"])
    return Workload(**{**common, "groups": groups}, **shape)


async def run_policies(url: str, w: Workload, slack: int, namespace: str) -> dict[str, Stats]:
    urls = [f"http://backend{i}:8000" for i in range(w.backends)]
    redis = Redis.from_url(url)
    balancer = Balancer(redis, namespace=namespace, group_affinity_slack=slack)
    for u in urls:
        await balancer.register(u)
    results = {
        "a": await simulate(LuaPolicy(balancer), urls, w),
        "b": await simulate(CounterPolicy(urls), urls, w),
        "c": await simulate(StickyLeastLoadedPolicy(), urls, w),
    }
    assert set((await balancer.in_flight()).values()) == {0}, "the Lua balancer leaked slots"
    await redis.aclose()
    return results


def print_table(title: str, results: dict[str, Stats]) -> None:
    names = {"a": LuaPolicy.name, "b": CounterPolicy.name, "c": StickyLeastLoadedPolicy.name}
    print(f"\n{title}")
    print(f"  {'policy':36} {'requests':>9} {'hit ratio':>9} {'reused Mtok':>11} "
          f"{'p99 depth':>9} {'p99 imbalance':>13}")
    for key, s in results.items():
        print(
            f"  {names[key]:36} {s.requests:9d} {s.hit_tokens / s.prompt_tokens:9.3f} "
            f"{s.hit_tokens / 1e6:11.2f} {p99(s.depth_samples):9.1f} "
            f"{p99(s.imbalance_samples):13.1f}"
        )
    a, b, c = results["a"], results["b"], results["c"]
    print(f"  reuse (a)/(b) = {a.hit_tokens / b.hit_tokens:.2f}x, "
          f"(a)/(c) = {a.hit_tokens / c.hit_tokens:.2f}x")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller workload (smoke run)")
    parser.add_argument("--slack", type=int, default=2, help="group_affinity_slack for (a)")
    parser.add_argument("--backends", type=int, default=Workload.backends)
    parser.add_argument("--groups", type=int, default=Workload.groups)
    parser.add_argument("--groups-in-flight", type=int, default=Workload.groups_in_flight)
    parser.add_argument("--cache-tokens", type=int, default=Workload.cache_tokens)
    parser.add_argument("--clients", type=int, default=16, help="concurrent Lua clients")
    parser.add_argument("--processes", type=int, default=2, help="processes they run in")
    parser.add_argument("--seconds", type=float, default=3.0, help="throughput run length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), action="append",
                        help="run only these workloads (default: all)")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    common = dict(
        backends=args.backends,
        groups=96 if args.quick else args.groups,
        groups_in_flight=args.groups_in_flight,
        cache_tokens=args.cache_tokens,
        seed=args.seed,
    )

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(Path(tmp))
        try:
            results = {
                name: await run_policies(url, workload(common, shape), args.slack, f"sim{i}")
                for i, (name, shape) in enumerate(WORKLOADS.items())
                if not args.workload or name in args.workload
            }
            if args.skip_throughput:
                single = pairs_per_s = capacity = 0.0
            else:
                single, _ = await lua_throughput(url, 1, 1, args.seconds)
                pairs_per_s, capacity = await lua_throughput(url, args.clients, args.processes, args.seconds)
        finally:
            proc.terminate()
            proc.wait()

    w = Workload(**common)
    print(
        f"{w.backends} backends, up to {w.groups} groups of G={w.group_size}, {w.groups_in_flight} "
        f"groups in flight, {w.cache_tokens:,} cacheable tokens/backend, "
        f"group_affinity_slack={args.slack}"
    )
    for name, res in results.items():
        shape = WORKLOADS[name]
        print_table(f"workload {name}: prompt {shape['prompt_tokens']} tokens, turns "
                    f"{shape['turns']}, observations {shape['obs_tokens']} tokens", res)
    print(f"\nLua acquire+release pairs/s: 1 client {single:,.0f}; {args.clients} clients in "
          f"{args.processes} processes {pairs_per_s:,.0f}; Redis-side capacity "
          f"(1 / EVALSHA time per pair) {capacity:,.0f}")

    if set(results) != set(WORKLOADS):
        return
    a, b, c = (results["tool-use"][k] for k in "abc")
    la, lb, lc = (results["long-horizon"][k] for k in "abc")
    result = {
        "reuse_vs_counter": round(a.hit_tokens / max(b.hit_tokens, 1), 3),
        "reuse_vs_sticky": round(a.hit_tokens / max(c.hit_tokens, 1), 3),
        "imbalance_p99": p99(a.imbalance_samples),
        "imbalance_p99_sticky": p99(c.imbalance_samples),
        "imbalance_p99_counter": p99(b.imbalance_samples),
        "hit_ratio": round(a.hit_tokens / a.prompt_tokens, 4),
        "hit_ratio_counter": round(b.hit_tokens / b.prompt_tokens, 4),
        "hit_ratio_sticky": round(c.hit_tokens / c.prompt_tokens, 4),
        "queue_depth_p99": p99(a.depth_samples),
        "queue_depth_p99_sticky": p99(c.depth_samples),
        "long_horizon_reuse_vs_counter": round(la.hit_tokens / max(lb.hit_tokens, 1), 3),
        "long_horizon_reuse_vs_sticky": round(la.hit_tokens / max(lc.hit_tokens, 1), 3),
        "long_horizon_imbalance_p99": p99(la.imbalance_samples),
        "long_horizon_imbalance_p99_sticky": p99(lc.imbalance_samples),
        "lua_pairs_per_s": round(pairs_per_s),
        "lua_pairs_per_s_single_client": round(single),
        "lua_server_capacity_pairs_per_s": round(capacity),
        "group_affinity_slack": args.slack,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    asyncio.run(main())
