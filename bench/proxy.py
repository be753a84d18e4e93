"""What the per-job OpenAI-compatible door (rollstream/agent/gateway.py) adds to a harness's
model call, and how many calls per second it serves to 64 harnesses at once.

Both paths use the same client (the official ``openai`` SDK) against the same backend: a
stub server in its own process that answers at once with a canned tool call (so the figures
are the door's cost, not a model's). "direct" asks the stub's /v1/chat/completions;
"door" asks the door, which renders the chat template, extends the job's token sequence,
leases a backend from the Lua balancer on a private redis-server (job and group affinity),
calls the stub's /v1/completions token-in/token-out, records ids and logprobs, parses the
tool call and answers. Each harness runs episodes of --turns calls (a tool result appended
after each), as an agent does; door and direct episodes alternate, so drift hits both.

Run: python bench/proxy.py [--episodes 40] [--turns 8] [--harnesses 64] [--seconds 10]
Last line: RESULT {"added_p50_ms", "added_p90_ms", "door_p50_ms", "direct_p50_ms",
"throughput_calls_per_s", "direct_throughput_calls_per_s", "harnesses", "load_avg", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOL_CALL = '<tool_call>\n{"name": "bash", "arguments": {"command": "echo $((2+3))"}}\n</tool_call>'


# -- the stub backend (its own process) ---------------------------------------------------
async def _stub(port_file: str, completion_ids: list[int]) -> None:
    completion = json.dumps({
        "id": "cmpl-stub", "object": "text_completion", "model": "stub",
        "choices": [{"index": 0, "text": TOOL_CALL, "token_ids": completion_ids, "finish_reason": "stop",
                     "logprobs": {"token_logprobs": [-0.5] * len(completion_ids)}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": len(completion_ids)}}).encode()
    chat = json.dumps({
        "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "bash", "arguments": '{"command": "echo $((2+3))"}'}}]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": len(completion_ids), "total_tokens": 2}}).encode()
    models = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()

    async def serve(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, _, rest = head.partition(b"\r\n")
                length = 0
                for h in rest.split(b"\r\n"):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                path = line.split(b" ")[1]
                body = completion if path.endswith(b"/completions") and b"chat" not in path else \
                    chat if b"chat" in path else models
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    async with server:
        await server.serve_forever()


def start_stub(completion_ids: list[int]) -> tuple[subprocess.Popen, str]:
    port_file = tempfile.mktemp(prefix="rs-proxy-stub-")
    proc = subprocess.Popen([sys.executable, __file__, "--stub", port_file, json.dumps(completion_ids)])
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file) or not Path(port_file).read_text():
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the stub backend did not start")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{Path(port_file).read_text()}"


# -- the harness side ---------------------------------------------------------------------
async def episode(client, tools: list[dict], turns: int, timings: list[float]) -> None:
    """One harness episode; appends each call's latency (s) to ``timings``."""
    from rollstream.tasks import arith

    messages = arith.prompt({"a": 2, "op": "+", "b": 3})
    for _ in range(turns):
        t0 = time.perf_counter()
        reply = (await client.chat.completions.create(model="stub", messages=messages, tools=tools)).choices[0]
        timings.append(time.perf_counter() - t0)
        messages.append(reply.message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "5\n"} for c in reply.message.tool_calls or []]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def run(args) -> dict:
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    from rollstream.agent import AgentSettings, LLMSession
    from rollstream.agent.backend_link import PooledVLLMClient
    from rollstream.agent.gateway import Gateway
    from rollstream.agent.harnesses.openai_chat import SUBMIT
    from rollstream.llm.inference_client import SamplingParams
    from rollstream.demo.arith_model import build_arith_model
    from rollstream.pipeline.balancer import Balancer, add_backend
    from rollstream.pipeline.connection import async_redis
    from rollstream.pipeline.embedded import EmbeddedRedis
    from rollstream.tasks import arith
    from transformers import AutoTokenizer

    model_dir = build_arith_model(Path.home() / ".cache" / "rollstream" / "tests" / "arith-model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    completion_ids = tokenizer.encode(TOOL_CALL + "<|im_end|>", add_special_tokens=False)
    stub, stub_url = start_stub(completion_ids)
    tools = [arith.BASH_SCHEMA, SUBMIT]
    settings = AgentSettings(max_turns=10**6, max_tokens_per_turn=64, max_context_tokens=32768,
                             sampling=SamplingParams(temperature=1.0, max_tokens=64))
    tmp = Path(tempfile.mkdtemp(prefix="rs-proxy-"))
    backend = PooledVLLMClient()  # the door's link to the backends (as run_harness uses)
    gateway = await Gateway().start()
    try:
        with EmbeddedRedis(tmp / "redis", appendonly=False) as server:
            r = async_redis(server.url)
            await add_backend(r, stub_url, "bench")
            balancer = Balancer(r, namespace="bench")
            job_ids = iter(range(10**9))

            def door_path(balanced: bool):
                async def one(timings):
                    job = f"job-{next(job_ids)}"
                    session = LLMSession(backend, job, group_id=f"group-{int(job[4:]) // 8}",
                                         **({"balancer": balancer} if balanced else {"backend_url": stub_url}))
                    door = gateway.open(job, session, tokenizer, settings)
                    client = AsyncOpenAI(base_url=gateway.base_url, api_key=door.key, max_retries=0,
                                         http_client=http)
                    try:
                        await episode(client, tools, args.turns, timings)
                    finally:
                        gateway.close(door)
                        await session.close()
                return one

            http = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000))
            direct_client = AsyncOpenAI(base_url=stub_url + "/v1", api_key="none", max_retries=0, http_client=http)
            paths = {"direct": lambda timings: episode(direct_client, tools, args.turns, timings),
                     "door": door_path(False), "door+balancer": door_path(True)}
            for one in paths.values():  # warm-up: connections, the template's jinja, the balancer's script
                await one([])
            lat: dict[str, list[float]] = {name: [] for name in paths}
            cpu: dict[str, float] = {name: 0.0 for name in paths}
            for _ in range(args.episodes):  # alternating, so machine load hits every path alike
                for name, one in paths.items():
                    c0 = time.process_time()
                    await one(lat[name])
                    cpu[name] += time.process_time() - c0

            async def closed_loop(one, seconds: float) -> float:
                done: list[float] = []
                stop = time.monotonic() + seconds

                async def harness():
                    while time.monotonic() < stop:
                        await one(done)

                started = time.monotonic()
                await asyncio.gather(*(harness() for _ in range(args.harnesses)))
                return len(done) / (time.monotonic() - started)

            tput = {name: await closed_loop(paths[name], args.seconds) for name in ("direct", "door+balancer")}
            await http.aclose()
            await r.aclose()
    finally:
        await gateway.aclose()
        await backend.aclose()
        stub.kill()
        stub.wait()
    calls = len(lat["direct"])
    door, direct, bare = lat["door+balancer"], lat["direct"], lat["door"]
    return {
        "added_p50_ms": round(pct(door, 0.5) - pct(direct, 0.5), 3),
        "added_p90_ms": round(pct(door, 0.9) - pct(direct, 0.9), 3),
        "added_p50_ms_without_balancer": round(pct(bare, 0.5) - pct(direct, 0.5), 3),
        "door_p50_ms": round(pct(door, 0.5), 3), "door_p90_ms": round(pct(door, 0.9), 3),
        "door_without_balancer_p50_ms": round(pct(bare, 0.5), 3),
        "direct_p50_ms": round(pct(direct, 0.5), 3), "direct_p90_ms": round(pct(direct, 0.9), 3),
        # CPU of this process (client + door) per call: what the door costs, whatever the load
        "added_cpu_ms_per_call": round((cpu["door+balancer"] - cpu["direct"]) / calls * 1000, 3),
        "calls_measured": calls, "turns_per_episode": args.turns,
        "throughput_calls_per_s": round(tput["door+balancer"], 1),
        "direct_throughput_calls_per_s": round(tput["direct"], 1),
        "harnesses": args.harnesses, "cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--stub":
        asyncio.run(_stub(sys.argv[2], json.loads(sys.argv[3])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=40, help="episodes per path for the latency figures")
    ap.add_argument("--turns", type=int, default=8, help="model calls per episode")
    ap.add_argument("--harnesses", type=int, default=64, help="concurrent harnesses for the throughput figure")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each throughput run")
    args = ap.parse_args()
    load_before = os.getloadavg()
    res = run_result = asyncio.run(run(args))
    print(f"{'path':<16} {'p50 ms':>8} {'p90 ms':>8} {'calls/s (' + str(args.harnesses) + ' harnesses)':>28}")
    print(f"{'direct':<16} {res['direct_p50_ms']:>8.3f} {res['direct_p90_ms']:>8.3f} "
          f"{res['direct_throughput_calls_per_s']:>28.1f}")
    print(f"{'door':<16} {res['door_without_balancer_p50_ms']:>8.3f} {'':>8} {'':>28}")
    print(f"{'door+balancer':<16} {res['door_p50_ms']:>8.3f} {res['door_p90_ms']:>8.3f} "
          f"{res['throughput_calls_per_s']:>28.1f}")
    print(f"added by the door (with the balancer): p50 {res['added_p50_ms']:.3f} ms, p90 {res['added_p90_ms']:.3f} ms, "
          f"CPU {res['added_cpu_ms_per_call']:.3f} ms per call ({res['calls_measured']} calls per path, "
          f"{args.turns}-turn episodes); "
          f"load average before {load_before[0]:.2f}, after {res['load_avg'][0]:.2f} on {res['cpus']} CPUs")
    run_result["load_avg_before"] = [round(x, 2) for x in load_before]
    print("RESULT " + json.dumps(run_result))


if __name__ == "__main__":
    main()
