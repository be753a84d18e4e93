"""What the per-job door (rollstream/agent/gateway.py) adds to a harness's model call, for each API
it speaks (OpenAI Chat Completions, OpenAI Responses, Anthropic Messages; whole and, streamed, to
the first text), and how many calls per second it serves to 64 harnesses at once.

Both paths use the same client (the official ``openai`` SDK) against the same backend: a
stub server in its own process that answers at once with a canned tool call (so the figures
are the door's cost, not a model's). "direct" asks the stub's /v1/chat/completions;
"door" asks the door, which renders the chat template, extends the job's token sequence,
leases a backend from the Lua balancer on a private redis-server (job and group affinity),
calls the stub's /v1/completions token-in/token-out, records ids and logprobs, parses the
tool call and answers. Each harness runs episodes of --turns calls (a tool result appended
after each), as an agent does; door and direct episodes alternate, so drift hits both.

Per API, the same client library (``openai`` for Chat and Responses, ``anthropic`` for Messages)
asks the stub in that API directly, or the door (with the balancer) in it: whole calls with a
tool call to parse, and streamed calls of a text reply timed to their first text delta (the stub
streams /v1/completions token by token, and each API's events when asked directly).

The doors run in a process of their own, as a run worker's do beside the harnesses (in-sandbox
CLIs) they serve: what a door does once its answer is sent (the lease's release, the history's
rendering ahead of the next call) then runs beside the harness, as it does in a deployment, not
in front of the harness's next step on one thread. ``--door-in-process`` serves them in the
bench's own thread instead (as for a Python-callable harness on the run worker), the layout of
the figures before session 13. CPU per call is counted in both processes.

Run: python bench/proxy.py [--episodes 40] [--api-episodes 15] [--turns 8] [--harnesses 64] [--seconds 10]
     [--door-in-process]
Last line: RESULT {"added_p50_ms", "added_p90_ms", "door_p50_ms", "direct_p50_ms",
"throughput_calls_per_s", "direct_throughput_calls_per_s", "harnesses", "load_avg",
"added_p50_ms_chat", "added_p50_ms_responses", "added_p50_ms_anthropic", "ttft_added_p50_ms_chat",
"ttft_added_p50_ms_responses", "ttft_added_p50_ms_anthropic", "door_in", "door_process_cpu_ms_per_call", ...}.
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
TEXT_REPLY = "The command printed 5, so the answer is 5."
MODEL_CACHE = Path.home() / ".cache" / "rollstream" / "tests" / "arith-model"
APIS = ("chat", "responses", "anthropic")


# -- the stub backend (its own process) ---------------------------------------------------
def _streams(text_ids: list[int]) -> dict[bytes, bytes]:
    """What the stub streams, by path: /v1/completions token by token (as vLLM does, ids and
    logprobs in each chunk), and each API's own events for the text reply (the door's emitters,
    so the direct calls parse the same events the door sends)."""
    from transformers import AutoTokenizer

    from rollstream.agent.door_anthropic import AnthropicEvents
    from rollstream.agent.door_chat import ChatEvents
    from rollstream.agent.door_models import ResponsesRequest
    from rollstream.agent.door_request import parse_request
    from rollstream.agent.door_responses import ResponsesEvents
    from rollstream.agent.door_stream import Completed

    tokenizer = AutoTokenizer.from_pretrained(os.environ["RS_PROXY_MODEL"])
    pieces = [tokenizer.decode([i]) for i in text_ids[:-1]]
    events = []
    for n, (token_id, piece) in enumerate(zip(text_ids, [*pieces, ""])):
        last = n == len(text_ids) - 1
        events.append({"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": [{
            "index": 0, "text": piece, "token_ids": [token_id], "logprobs": {"token_logprobs": [-0.5]},
            "finish_reason": "stop" if last else None, "stop_reason": None}]})
    usage = {"prompt_tokens": 1, "completion_tokens": len(text_ids), "total_tokens": 1 + len(text_ids)}
    events.append({"id": "cmpl-stub", "object": "text_completion", "model": "stub", "choices": [], "usage": usage})
    completions = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    done = Completed(content=TEXT_REPLY, calls=[], finish="stop", prompt_tokens=1, completion_tokens=len(text_ids))
    options = parse_request({"messages": [{"role": "user", "content": "-"}], "stream": True})
    out = {b"/v1/completions": completions}
    for path, emitter in ((b"/v1/chat/completions", ChatEvents("stub", options, tokenizer)),
                          (b"/v1/responses", ResponsesEvents(ResponsesRequest(model="stub", input="-"))),
                          (b"/v1/messages", AnthropicEvents("stub"))):
        out[path] = emitter.start(1) + b"".join(emitter.text(p, []) for p in pieces) + emitter.finish(done)
    return out


async def _stub(port_file: str, completion_ids: list[int], text_ids: list[int]) -> None:
    streams = _streams(text_ids)
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
    arguments = {"command": "echo $((2+3))"}
    answers = {
        b"/v1/completions": completion, b"/v1/chat/completions": chat,
        b"/v1/responses": json.dumps({
            "id": "resp_stub", "object": "response", "created_at": 0, "status": "completed", "model": "stub",
            "output": [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "bash",
                        "arguments": json.dumps(arguments), "status": "completed"}],
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
            "usage": {"input_tokens": 1, "output_tokens": len(completion_ids), "total_tokens": 2,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}
        }).encode(),
        b"/v1/messages": json.dumps({
            "id": "msg_stub", "type": "message", "role": "assistant", "model": "stub",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "bash", "input": arguments}],
            "stop_reason": "tool_use", "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": len(completion_ids)}}).encode()}

    async def serve(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, _, rest = head.partition(b"\r\n")
                length = 0
                for h in rest.split(b"\r\n"):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                request = await reader.readexactly(length) if length else b""
                path = line.split(b" ")[1].split(b"?")[0]
                streamed = b'"stream": true' in request or b'"stream":true' in request
                body = (streams if streamed else answers).get(path, models)
                kind = b"text/event-stream" if streamed else b"application/json"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                             % (kind, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
    async with server:
        await server.serve_forever()


def start_stub(completion_ids: list[int], text_ids: list[int], model_dir: Path) -> tuple[subprocess.Popen, str]:
    port_file = tempfile.mktemp(prefix="rs-proxy-stub-")
    proc = subprocess.Popen([sys.executable, __file__, "--stub", port_file, json.dumps(completion_ids),
                             json.dumps(text_ids)], env={**os.environ, "RS_PROXY_MODEL": str(model_dir)})
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
        reply = (await client.chat.completions.create(model="rollstream", messages=messages, tools=tools)).choices[0]
        timings.append(time.perf_counter() - t0)
        messages.append(reply.message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "5\n"} for c in reply.message.tool_calls or []]


def _tools_of(api: str, tools: list[dict]) -> list[dict]:
    if api == "responses":
        return [{"type": "function", **t["function"]} for t in tools]
    if api == "anthropic":
        return [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in tools]
    return tools


async def api_episode(api: str, client, tools: list[dict], turns: int, timings: list[float]) -> None:
    """An episode in ``api`` of whole calls with a tool call each; appends each call's latency."""
    from rollstream.tasks import arith

    system, user = arith.prompt({"a": 2, "op": "+", "b": 3})
    if api == "chat":
        await episode(client, tools, turns, timings)
        return
    api_tools = _tools_of(api, tools)
    history: list[dict] = [{"role": "user", "content": user["content"]}]
    for _ in range(turns):
        t0 = time.perf_counter()
        if api == "responses":
            reply = await client.responses.create(model="rollstream", instructions=system["content"], input=history,
                                                  tools=api_tools, store=False)
            timings.append(time.perf_counter() - t0)
            history += [item.model_dump(exclude_none=True) for item in reply.output]
            history += [{"type": "function_call_output", "call_id": item.call_id, "output": "5\n"}
                        for item in reply.output if item.type == "function_call"]
        else:
            reply = await client.messages.create(model="rollstream", max_tokens=64, system=system["content"],
                                                 messages=history, tools=api_tools)
            timings.append(time.perf_counter() - t0)
            history.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
            history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "5\n"}
                                                        for b in reply.content if b.type == "tool_use"]})


async def first_text(api: str, client, turns: int, timings: list[float]) -> None:
    """An episode in ``api`` of streamed calls; appends each call's time to its first text delta."""
    history: list[dict] = [{"role": "user", "content": "What does echo $((2+3)) print?"}]
    for _ in range(turns):
        t0, first, text = time.perf_counter(), None, []
        if api == "chat":
            stream = await client.chat.completions.create(model="rollstream", messages=history, stream=True)
            async for chunk in stream:
                piece = chunk.choices[0].delta.content if chunk.choices else None
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
        elif api == "responses":
            async with client.responses.stream(model="rollstream", input=history, store=False) as stream:
                async for event in stream:
                    if event.type == "response.output_text.delta":
                        first = first or time.perf_counter()
                        text.append(event.delta)
        else:
            async with client.messages.stream(model="rollstream", max_tokens=64, messages=history) as stream:
                async for event in stream:
                    if event.type == "content_block_delta" and event.delta.type == "text_delta":
                        first = first or time.perf_counter()
                        text.append(event.delta.text)
        assert first is not None and "".join(text) == TEXT_REPLY, (api, text)
        timings.append(first - t0)
        history += [{"role": "assistant", "content": "".join(text)}, {"role": "user", "content": "And then?"}]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


# -- the doors: in a process of their own (as a run worker's are), or in the bench's ----------
class Doors:
    """One Gateway (the run worker's door server) on which each episode opens a job's door, as
    run_harness does: the job's LLM session (through the balancer, or straight to the stub) and key."""

    def __init__(self, redis_url: str, stub_url: str) -> None:
        self.redis_url, self.stub_url = redis_url, stub_url
        self.open_doors: dict = {}

    async def start(self) -> Doors:
        from transformers import AutoTokenizer

        from rollstream.agent.gateway import Gateway
        from rollstream.demo.arith_model import build_arith_model
        from rollstream.episode_settings import AgentSettings
        from rollstream.llm.backend_link import PooledVLLMClient
        from rollstream.llm.balancer import Balancer
        from rollstream.llm.inference_client import SamplingParams
        from rollstream.pipeline.connection import async_redis

        self.tokenizer = AutoTokenizer.from_pretrained(build_arith_model(MODEL_CACHE))
        self.settings = AgentSettings(max_turns=10**6, max_tokens_per_turn=64, max_context_tokens=32768,
                                      sampling=SamplingParams(temperature=1.0, max_tokens=64))
        self.backend = PooledVLLMClient()  # the door's link to the backends (as run_harness uses)
        self.gateway = await Gateway().start()
        self.redis = async_redis(self.redis_url)
        self.balancer = Balancer(self.redis, namespace="bench")
        self.base_url = self.gateway.base_url
        return self

    async def open(self, job: str, balanced: bool) -> str:
        from rollstream.llm.session import LLMSession

        session = LLMSession(self.backend, job, group_id=f"group-{int(job[4:]) // 8}",
                             **({"balancer": self.balancer} if balanced else {"backend_url": self.stub_url}))
        door = self.gateway.open(job, session, self.tokenizer, self.settings)
        self.open_doors[door.key] = door
        return door.key

    async def close(self, key: str) -> None:
        door = self.open_doors.pop(key)
        self.gateway.close(door)
        await door.session.close()

    async def cpu_s(self) -> float:
        return 0.0  # in the bench's process: its CPU is counted with the harness's

    async def aclose(self) -> None:
        await self.gateway.aclose()
        await self.backend.aclose()
        await self.redis.aclose()


class DoorProcess:
    """The doors in a process of their own, driven over its stdin and stdout one JSON line at a
    time (between episodes, never during a call): the run worker is a process apart from the
    harnesses it serves, so what the door does once an answer is sent (the lease's release, the
    history's rendering for the next call) runs beside the harness, not before it."""

    async def start(self, redis_url: str, stub_url: str) -> DoorProcess:
        self.lock = asyncio.Lock()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--doors", redis_url, stub_url,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.base_url = await self._ask({"op": "url"})
        return self

    async def _ask(self, message: dict):
        async with self.lock:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            await self.proc.stdin.drain()
            line = await self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the door process exited; its stderr says why")
        return json.loads(line)

    async def open(self, job: str, balanced: bool) -> str:
        return await self._ask({"op": "open", "job": job, "balanced": balanced})

    async def close(self, key: str) -> None:
        await self._ask({"op": "close", "key": key})

    async def cpu_s(self) -> float:
        return await self._ask({"op": "cpu"})

    async def aclose(self) -> None:
        self.proc.stdin.close()  # its end of input: it closes its doors and exits
        try:
            await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def serve_doors(redis_url: str, stub_url: str) -> None:
    """The door process's body: DoorProcess's requests on stdin, their answers on stdout."""
    answers, sys.stdout = sys.stdout, sys.stderr  # whatever else prints must not reach DoorProcess
    doors = await Doors(redis_url, stub_url).start()
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            message = json.loads(line)
            op = message["op"]
            if op == "url":
                answer = doors.base_url
            elif op == "open":
                answer = await doors.open(message["job"], message["balanced"])
            elif op == "close":
                answer = await doors.close(message["key"])
            else:
                answer = time.process_time()
            answers.write(json.dumps(answer) + "\n")
            answers.flush()
    finally:
        await doors.aclose()


async def run(args) -> dict:
    import httpx
    from anthropic import AsyncAnthropic
    from anthropic import DefaultAsyncHttpxClient as DefaultAnthropicHttpxClient
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient
    from transformers import AutoTokenizer

    from rollstream.agent.harnesses.openai_chat import SUBMIT
    from rollstream.demo.arith_model import build_arith_model
    from rollstream.llm.balancer import add_backend
    from rollstream.pipeline.connection import async_redis
    from rollstream.pipeline.embedded import EmbeddedRedis
    from rollstream.tasks import arith

    model_dir = build_arith_model(MODEL_CACHE)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    completion_ids = tokenizer.encode(TOOL_CALL + "<|im_end|>", add_special_tokens=False)
    text_ids = tokenizer.encode(TEXT_REPLY + "<|im_end|>", add_special_tokens=False)
    stub, stub_url = start_stub(completion_ids, text_ids, model_dir)
    tools = [arith.BASH_SCHEMA, SUBMIT]
    tmp = Path(tempfile.mkdtemp(prefix="rs-proxy-"))
    doors: Doors | DoorProcess | None = None
    try:
        with EmbeddedRedis(tmp / "redis", appendonly=False) as server:
            r = async_redis(server.url)
            await add_backend(r, stub_url, "bench")
            doors = await (Doors(server.url, stub_url).start() if args.door_in_process
                           else DoorProcess().start(server.url, stub_url))
            job_ids = iter(range(10**9))

            def client_of(api: str, base_url: str, key: str):
                if api == "anthropic":
                    return AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=key, max_retries=0,
                                          http_client=anthropic_http)
                return AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, http_client=http)

            def door_path(balanced: bool, run_episode=None, api: str = "chat"):
                run_episode = run_episode or (lambda client, timings: episode(client, tools, args.turns, timings))

                async def one(timings):
                    key = await doors.open(f"job-{next(job_ids)}", balanced)
                    try:
                        await run_episode(client_of(api, doors.base_url, key), timings)
                    finally:
                        await doors.close(key)
                return one

            http = DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=1000))
            anthropic_http = DefaultAnthropicHttpxClient(limits=httpx.Limits(max_connections=1000,
                                                                             max_keepalive_connections=1000))
            direct_client = AsyncOpenAI(base_url=stub_url + "/v1", api_key="none", max_retries=0, http_client=http)
            paths = {"direct": lambda timings: episode(direct_client, tools, args.turns, timings),
                     "door": door_path(False), "door+balancer": door_path(True)}
            async def cpu_of(one, timings: list[float]) -> tuple[float, float]:
                """Run ``one``; the CPU seconds it took in this process and in the door's."""
                c0, d0 = time.process_time(), await doors.cpu_s()
                await one(timings)
                return time.process_time() - c0, await doors.cpu_s() - d0

            for one in paths.values():  # warm-up: connections, the template's jinja, the balancer's script
                await one([])
            lat: dict[str, list[float]] = {name: [] for name in paths}
            cpu: dict[str, float] = {name: 0.0 for name in paths}
            door_cpu: dict[str, float] = {name: 0.0 for name in paths}  # of the door's own process
            for _ in range(args.episodes):  # alternating, so machine load hits every path alike
                for name, one in paths.items():
                    here, there = await cpu_of(one, lat[name])
                    cpu[name] += here + there
                    door_cpu[name] += there

            async def closed_loop(one, seconds: float) -> float:
                done: list[float] = []
                stop = time.monotonic() + seconds

                async def harness():
                    while time.monotonic() < stop:
                        await one(done)

                started = time.monotonic()
                await asyncio.gather(*(harness() for _ in range(args.harnesses)))
                return len(done) / (time.monotonic() - started)

            # Per API: whole calls (a tool call each) and streamed ones (to the first text delta),
            # direct and through the door with the balancer, alternating.
            def measured(api: str, streamed: bool):
                def run_episode(client, timings):
                    if streamed:
                        return first_text(api, client, args.turns, timings)
                    return api_episode(api, client, tools, args.turns, timings)

                direct = client_of(api, stub_url + "/v1", "none")
                return {"direct": lambda timings: run_episode(direct, timings),
                        "door": door_path(True, run_episode, api)}

            per_api: dict[tuple[str, bool], dict[str, list[float]]] = {}
            api_cpu: dict[tuple[str, bool], float] = {}  # CPU the door adds per call (both processes)
            api_door_cpu: dict[tuple[str, bool], float] = {}  # CPU of the door's own process per call
            for api in APIS:
                for streamed in (False, True):
                    pair = measured(api, streamed)
                    for one in pair.values():
                        await one([])
                    got: dict[str, list[float]] = {name: [] for name in pair}
                    spent = {name: 0.0 for name in pair}
                    door_spent = 0.0
                    for _ in range(args.api_episodes):
                        for name, one in pair.items():
                            here, there = await cpu_of(one, got[name])
                            spent[name] += here + there
                            door_spent += there if name == "door" else 0.0
                    per_api[(api, streamed)] = got
                    api_cpu[(api, streamed)] = (spent["door"] - spent["direct"]) / len(got["door"])
                    api_door_cpu[(api, streamed)] = door_spent / len(got["door"])
            # Last: its 64 harnesses leave as many pooled keep-alive connections in the shared client, which
            # httpcore polls on every later request (has_expired), so no latency figure is measured after it.
            tput = {name: await closed_loop(paths[name], args.seconds) for name in ("direct", "door+balancer")}
            await anthropic_http.aclose()
            await http.aclose()
            await r.aclose()
    finally:
        if doors is not None:
            await doors.aclose()
        stub.kill()
        stub.wait()
    calls = len(lat["direct"])
    door, direct, bare = lat["door+balancer"], lat["direct"], lat["door"]
    apis: dict = {}
    for (api, streamed), got in per_api.items():
        prefix = "ttft_" if streamed else ""
        apis[f"{prefix}added_p50_ms_{api}"] = round(pct(got["door"], 0.5) - pct(got["direct"], 0.5), 3)
        apis[f"{prefix}door_p50_ms_{api}"] = round(pct(got["door"], 0.5), 3)
        apis[f"{prefix}direct_p50_ms_{api}"] = round(pct(got["direct"], 0.5), 3)
        apis[f"{prefix}added_cpu_ms_per_call_{api}"] = round(api_cpu[(api, streamed)] * 1000, 3)
        if not args.door_in_process:
            apis[f"{prefix}door_process_cpu_ms_per_call_{api}"] = round(api_door_cpu[(api, streamed)] * 1000, 3)
    return {**apis, "api_calls_measured": len(per_api[("chat", False)]["door"]),
        "added_p50_ms": round(pct(door, 0.5) - pct(direct, 0.5), 3),
        "added_p90_ms": round(pct(door, 0.9) - pct(direct, 0.9), 3),
        "added_p50_ms_without_balancer": round(pct(bare, 0.5) - pct(direct, 0.5), 3),
        "door_p50_ms": round(pct(door, 0.5), 3), "door_p90_ms": round(pct(door, 0.9), 3),
        "door_without_balancer_p50_ms": round(pct(bare, 0.5), 3),
        "direct_p50_ms": round(pct(direct, 0.5), 3), "direct_p90_ms": round(pct(direct, 0.9), 3),
        # CPU per call the door path costs beyond the direct one (client, door and, in a process of
        # its own, the door's process): what the door costs, whatever the load
        "added_cpu_ms_per_call": round((cpu["door+balancer"] - cpu["direct"]) / calls * 1000, 3),
        "door_process_cpu_ms_per_call": None if args.door_in_process
        else round(door_cpu["door+balancer"] / calls * 1000, 3),
        "door_in": "bench process" if args.door_in_process else "own process",
        "calls_measured": calls, "turns_per_episode": args.turns,
        "throughput_calls_per_s": round(tput["door+balancer"], 1),
        "direct_throughput_calls_per_s": round(tput["direct"], 1),
        "harnesses": args.harnesses, "cpus": os.cpu_count(), "load_avg": [round(x, 2) for x in os.getloadavg()],
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--stub":
        asyncio.run(_stub(sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--doors":
        asyncio.run(serve_doors(sys.argv[2], sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, default=40, help="episodes per path for the latency figures")
    ap.add_argument("--api-episodes", type=int, default=15,
                    help="episodes per API, path and mode (whole, streamed) for the per-API figures")
    ap.add_argument("--turns", type=int, default=8, help="model calls per episode")
    ap.add_argument("--harnesses", type=int, default=64, help="concurrent harnesses for the throughput figure")
    ap.add_argument("--seconds", type=float, default=10.0, help="length of each throughput run")
    ap.add_argument("--door-in-process", action="store_true",
                    help="serve the doors in the bench's own process and thread, beside the harnesses (as for a "
                         "Python-callable harness on the run worker), not in a process of their own")
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
          f"{args.turns}-turn episodes; the door in the {res['door_in']}"
          + (f", whose own CPU is {res['door_process_cpu_ms_per_call']:.3f} ms per call" if not args.door_in_process
             else "") + "); "
          f"load average before {load_before[0]:.2f}, after {res['load_avg'][0]:.2f} on {res['cpus']} CPUs")
    print(f"\n{'API':<11} {'whole: direct':>14} {'door':>8} {'added':>8} {'CPU':>6}   {'to first text: direct':>22} "
          f"{'door':>8} {'added':>8} {'CPU':>6}   "
          f"(p50 ms; CPU ms added per call; {res['api_calls_measured']} calls each)")
    for api in APIS:
        print(f"{api:<11} {res['direct_p50_ms_' + api]:>14.3f} {res['door_p50_ms_' + api]:>8.3f} "
              f"{res['added_p50_ms_' + api]:>8.3f} {res['added_cpu_ms_per_call_' + api]:>6.2f}   "
              f"{res['ttft_direct_p50_ms_' + api]:>22.3f} {res['ttft_door_p50_ms_' + api]:>8.3f} "
              f"{res['ttft_added_p50_ms_' + api]:>8.3f} {res['ttft_added_cpu_ms_per_call_' + api]:>6.2f}")
    run_result["load_avg_before"] = [round(x, 2) for x in load_before]
    print("RESULT " + json.dumps(run_result))


if __name__ == "__main__":
    main()
