"""Token-in/token-out clients for LLM inference servers, used by the run stage's agent loop:
unmodified vLLM's OpenAI-compatible /v1/completions (also spoken by the built-in server) and
SGLang's native /generate. Output ids and logprobs are the server's own, never re-tokenized."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Literal, NoReturn, Protocol, runtime_checkable

import httpx
from pydantic import BaseModel

from rollstream.sampling import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
# A backend that is down refuses or drops the connection at once; waiting long for the
# TCP handshake only delays the retry on another backend.
CONNECT_TIMEOUT_S = 5.0
# A backend cut off by the network neither refuses nor answers: a request already sent would
# wait out its whole timeout (minutes, since a long generation is legitimate). The kernel finds
# such a peer instead: keep-alive probes after this many idle seconds (a live server's kernel
# answers them however long the generation), and data unacknowledged this long, fail the
# connection; the turn is then retried on another backend. Settings.inference_dead_peer_s.
DEAD_PEER_S = 15.0


def _dead_peer_socket_options(dead_peer_s: float = DEAD_PEER_S) -> list[tuple[int, int, int]]:
    import socket

    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    idle_s = max(1, int(dead_peer_s // 3))
    interval_s = max(1, min(2, int(dead_peer_s // 3)))
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", max(1000, int(dead_peer_s * 1000)))):
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


class Generation(BaseModel):
    """One model turn as the server produced it: token ids and one logprob per id."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    stop_reason: int | str | None = None
    prompt_tokens: int | None = None
    # Prompt tokens the server took from its prefix cache, where it reports them.
    cached_tokens: int | None = None
    backend: str = ""
    # Only servers that know it report it (the built-in server, SGLang's weight_version).
    policy_version: int | None = None


# Called with each piece of a streamed generation as the backend sends it: the new token ids and
# their logprobs, the backend's own (the Generation that ends the stream holds them all).
TokensCallback = Callable[[list[int], list[float]], Awaitable[None]]


class BackendError(RuntimeError):
    """An inference backend failed a request. `retryable` is True when another backend (or
    the same one later) may succeed: connection errors, timeouts, 5xx, overload."""

    def __init__(self, backend: str, reason: str, *, retryable: bool = True, status_code: int | None = None):
        self.backend = backend
        self.reason = reason
        self.retryable = retryable
        self.status_code = status_code
        hint = "retry on another backend" if retryable else "fix the request; retrying will not help"
        super().__init__(f"backend {backend} failed: {reason} ({hint})")


class ContextLengthError(BackendError):
    """The prompt plus max_tokens exceeds the model's context window (finish reason `context`)."""

    def __init__(self, backend: str, reason: str, status_code: int | None = 400):
        super().__init__(backend, reason, retryable=False, status_code=status_code)


@runtime_checkable
class CompletionBackend(Protocol):
    """What the agent loop needs from an inference server: ids in, ids + logprobs out."""

    async def generate(
        self, base_url: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> Generation: ...

    async def health(self, base_url: str, timeout_s: float = 5.0) -> bool: ...

    async def aclose(self) -> None: ...


def _looks_like_context_error(message: str) -> bool:
    text = message.lower()
    # vLLM clamps max_tokens to the room the prompt leaves; a prompt that fills the whole
    # context leaves none, which it reports as max_tokens 0 (the client never sends 0).
    return ("context length" in text or "maximum context" in text or "too long" in text
            or "max_tokens must be at least 1, got 0" in text)


def sse_events(buffer: bytearray) -> list[bytes]:
    """Take the complete server-sent events' ``data:`` payloads out of ``buffer`` (bytes as
    they arrived; what is left waits for the rest of its event)."""
    out: list[bytes] = []
    while True:
        end = buffer.find(b"\n\n")
        if end < 0:
            return out
        event = bytes(buffer[:end])
        del buffer[: end + 2]
        data = [line[5:].lstrip() for line in event.replace(b"\r\n", b"\n").split(b"\n") if line.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))


class StreamAssembly:
    """A streamed /v1/completions answer (vLLM's, or the built-in server's) put together chunk by
    chunk: each chunk's token ids and logprobs as they come, then the whole Generation."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.usage: dict = {}
        self.policy_version: int | None = None
        self.done = False

    def add(self, data: bytes) -> tuple[list[int], list[float]]:
        """One event's payload; returns the ids and logprobs it adds."""
        if data.strip() == b"[DONE]":
            self.done = True
            return [], []
        try:
            chunk = json.loads(data)
        except ValueError as exc:
            raise BackendError(self.base_url, f"vllm streamed a non-JSON event: {data[:200]!r}") from exc
        if not isinstance(chunk, dict):
            raise BackendError(self.base_url, f"vllm streamed {chunk!r:.200}", retryable=False)
        if "error" in chunk:  # an error after the stream had begun (vLLM sends it as an event)
            err = chunk["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise BackendError(self.base_url, f"vllm failed while streaming: {str(message)[:300]}")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("policy_version") is not None:
            self.policy_version = int(chunk["policy_version"])
        ids: list[int] = []
        logprobs: list[float] = []
        for choice in chunk.get("choices") or []:
            lp = choice.get("logprobs") or {}
            token_logprobs = lp.get("token_logprobs") or []
            token_ids = choice.get("token_ids")
            if token_ids is None:
                try:
                    token_ids = [_parse_token_id(t) for t in lp.get("tokens") or []]
                except ValueError as exc:
                    raise BackendError(self.base_url, f"cannot recover streamed token ids ({exc}); upgrade vLLM to "
                                       ">= 0.10.2 for return_token_ids", retryable=False) from exc
            if len(token_ids) != len(token_logprobs):
                raise BackendError(self.base_url, f"a streamed chunk has {len(token_ids)} token ids but "
                                   f"{len(token_logprobs)} logprobs", retryable=False)
            ids += [int(t) for t in token_ids]
            logprobs += [float("-inf") if x is None else float(x) for x in token_logprobs]
            self.text.append(choice.get("text") or "")
            if choice.get("finish_reason"):
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")
        self.token_ids += ids
        self.logprobs += logprobs
        return ids, logprobs

    def generation(self) -> Generation:
        if self.finish_reason is None:
            raise BackendError(self.base_url, "the backend's stream ended before the generation did")
        return Generation(token_ids=self.token_ids, logprobs=self.logprobs, finish_reason=self.finish_reason,
                          text="".join(self.text), stop_reason=self.stop_reason,
                          prompt_tokens=self.usage.get("prompt_tokens"),
                          cached_tokens=(self.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                          backend=self.base_url, policy_version=self.policy_version)


class _HTTPBackend:
    """Shared pooled httpx client, error mapping and health check."""

    kind = "http"

    def __init__(self, max_connections: int = 256, api_key: str | None = None, dead_peer_s: float = DEAD_PEER_S):
        self._max_connections = max_connections
        self._dead_peer_s = dead_peer_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _http(self) -> httpx.AsyncClient:
        # An httpx client is bound to the event loop that first used it; a worker that
        # runs several loops over its life (tests, asyncio.run per batch) gets a fresh one.
        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop or self._client.is_closed:
            limits = httpx.Limits(max_connections=self._max_connections, max_keepalive_connections=64)
            transport = httpx.AsyncHTTPTransport(limits=limits,
                                                 socket_options=_dead_peer_socket_options(self._dead_peer_s))
            self._client = httpx.AsyncClient(transport=transport, headers=self._headers)
            self._loop = loop
        return self._client

    async def aclose(self) -> None:
        if self._client is not None and not self._client.is_closed:
            try:
                await self._client.aclose()
            except RuntimeError:
                pass  # its loop is gone; the sockets went with it
        self._client = None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _request(self, method: str, url: str, base_url: str, timeout_s: float | None, **kw) -> dict:
        total = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        timeout = httpx.Timeout(total, connect=min(CONNECT_TIMEOUT_S, total))
        try:
            resp = await self._http().request(method, url, timeout=timeout, **kw)
        except httpx.HTTPError as exc:
            raise self._transport_error(base_url, total, exc) from exc
        if resp.status_code >= 400:
            raise_for_error_status(self.kind, base_url, resp)
        try:
            return resp.json()
        except ValueError as exc:
            raise BackendError(base_url, f"{self.kind} returned non-JSON body: {resp.text[:200]!r}") from exc

    def _transport_error(self, base_url: str, total: float, exc: Exception) -> BackendError:
        if isinstance(exc, (httpx.TimeoutException, asyncio.TimeoutError)):
            return BackendError(base_url, f"{self.kind} request timed out after {total:.1f}s ({type(exc).__name__})")
        return BackendError(base_url, f"{self.kind} unreachable: {type(exc).__name__}: {exc}")

    async def health(self, base_url: str, timeout_s: float = 5.0) -> bool:
        """True when GET /health answers 200 within timeout_s (vLLM, SGLang and the
        built-in server all serve it)."""
        try:
            resp = await self._http().get(f"{base_url.rstrip('/')}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200


def raise_for_error_status(kind: str, base_url: str, resp: httpx.Response) -> NoReturn:
    """The BackendError of a response with an error status: a ContextLengthError for a
    prompt the context cannot hold; retryable for 408/429 and 5xx (the server's trouble),
    not for other 4xx (the request's)."""
    message = _error_message(resp)
    if resp.status_code == 400 and _looks_like_context_error(message):
        raise ContextLengthError(base_url, message, status_code=resp.status_code)
    retryable = resp.status_code >= 500 or resp.status_code in (408, 429)
    raise BackendError(base_url, f"{kind} HTTP {resp.status_code}: {message}", retryable=retryable,
                       status_code=resp.status_code)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]


async def feed_stream(assembly: StreamAssembly, chunks, on_tokens: TokensCallback) -> None:
    """Feed a streamed answer's bytes (an async iterator) to ``assembly``, and the tokens of each
    read to ``on_tokens`` as they arrive, until [DONE]. The events that arrived in one read are
    passed on together: a listener that fell behind (the door, which writes an event to its harness
    per callback) catches up with one delta instead of one per token."""
    buffer = bytearray()
    async for data in chunks:
        buffer += data
        ids: list[int] = []
        logprobs: list[float] = []
        try:
            for event in sse_events(buffer):
                more_ids, more_logprobs = assembly.add(event)
                ids += more_ids
                logprobs += more_logprobs
                if assembly.done:
                    break
        finally:  # what arrived before a failed event is passed on first, as it was before it failed
            if ids:
                await on_tokens(ids, logprobs)
        if assembly.done:
            return


def _parse_token_id(token: str) -> int:
    # vLLM renders tokens as "token_id:123" when return_tokens_as_token_ids is set.
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not in 'token_id:N' form")
    return int(token[len("token_id:") :])


class VLLMClient(_HTTPBackend):
    """Client for vLLM's OpenAI-compatible server (and the built-in server, which serves the
    same subset). The prompt goes as a list of ids; `return_token_ids` makes vLLM (>= 0.10.2)
    return the generated ids, and `return_tokens_as_token_ids` makes older versions name
    each logprob's token as 'token_id:N', which is the fallback parsed here."""

    kind = "vllm"

    def __init__(self, model: str | None = None, max_connections: int = 256, api_key: str | None = None,
                 dead_peer_s: float = DEAD_PEER_S):
        super().__init__(max_connections=max_connections, api_key=api_key, dead_peer_s=dead_peer_s)
        self.model = model
        self._models: dict[str, str] = {}

    async def _model_name(self, base_url: str, timeout_s: float | None) -> str:
        if self.model is not None:
            return self.model
        if base_url not in self._models:
            body = await self._request("GET", f"{base_url}/v1/models", base_url, min(timeout_s or 30.0, 30.0))
            try:
                self._models[base_url] = body["data"][0]["id"]
            except (KeyError, IndexError, TypeError) as exc:
                raise BackendError(base_url, f"/v1/models lists no model: {body!r:.200}", retryable=False) from exc
        return self._models[base_url]

    def request_body(self, model: str, prompt_ids: list[int], params: SamplingParams, stream: bool = False) -> dict:
        body = {
            "model": model,
            "prompt": list(prompt_ids),
            "stream": stream,
            "n": 1,
            # One top logprob is enough: the sampled token's own logprob is always included.
            "logprobs": 1,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
        }
        if stream:  # the last event then carries the prompt's token count and its cached part
            body["stream_options"] = {"include_usage": True}
        body.update(params.model_dump(exclude_none=True, exclude=set(params.model_extra or {})))
        body.update(params.extra_fields())
        return body

    def parse_response(self, base_url: str, body: dict) -> Generation:
        try:
            choice = body["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise BackendError(base_url, f"vllm response has no choices: {body!r:.300}", retryable=False) from exc
        lp = choice.get("logprobs") or {}
        token_logprobs = lp.get("token_logprobs")
        if token_logprobs is None:
            raise BackendError(
                base_url, "vllm response has no logprobs; is 'logprobs' disabled on the server?", retryable=False
            )
        token_ids = choice.get("token_ids")
        if token_ids is None:
            try:
                token_ids = [_parse_token_id(t) for t in lp.get("tokens") or []]
            except ValueError as exc:
                raise BackendError(
                    base_url,
                    f"cannot recover token ids ({exc}); upgrade vLLM to >= 0.10.2 for return_token_ids",
                    retryable=False,
                ) from exc
        if len(token_ids) != len(token_logprobs):
            raise BackendError(
                base_url,
                f"{len(token_ids)} token ids but {len(token_logprobs)} logprobs in the response",
                retryable=False,
            )
        usage = body.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        version = body.get("policy_version")
        return Generation(
            token_ids=[int(t) for t in token_ids],
            # A None logprob (vLLM gives it for -inf) becomes -inf, never a silent 0.
            logprobs=[float("-inf") if x is None else float(x) for x in token_logprobs],
            finish_reason=choice.get("finish_reason") or "stop",
            text=choice.get("text") or "",
            stop_reason=choice.get("stop_reason"),
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=cached,
            backend=base_url,
            policy_version=int(version) if version is not None else None,
        )

    async def generate(
        self, base_url: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> Generation:
        base_url = base_url.rstrip("/")
        model = await self._model_name(base_url, timeout_s)
        body = self.request_body(model, prompt_ids, params)
        data = await self._request("POST", f"{base_url}/v1/completions", base_url, timeout_s, json=body)
        return self.parse_response(base_url, data)

    async def generate_stream(
        self,
        base_url: str,
        prompt_ids: list[int],
        params: SamplingParams,
        on_tokens: TokensCallback,
        timeout_s: float | None = None,
    ) -> Generation:
        """``generate`` streamed (stream=true): ``on_tokens`` gets each chunk's ids and logprobs
        as the backend sends them; the Generation returned is the whole turn, as ``generate``'s."""
        base_url = base_url.rstrip("/")
        model = await self._model_name(base_url, timeout_s)
        body = self.request_body(model, prompt_ids, params, stream=True)
        total = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        assembly = StreamAssembly(base_url)
        try:
            async with asyncio.timeout(total):
                async with self._http().stream(
                    "POST",
                    f"{base_url}/v1/completions",
                    json=body,
                    timeout=httpx.Timeout(total, connect=min(CONNECT_TIMEOUT_S, total)),
                ) as resp:
                    if resp.status_code >= 400:
                        await resp.aread()
                        raise_for_error_status(self.kind, base_url, resp)
                    await feed_stream(assembly, resp.aiter_bytes(), on_tokens)
        except (TimeoutError, httpx.HTTPError) as exc:
            raise self._transport_error(base_url, total, exc) from exc
        return assembly.generation()


class SGLangClient(_HTTPBackend):
    """Client for SGLang's native /generate endpoint: `input_ids` in, `output_ids` and
    meta_info.output_token_logprobs ([logprob, token_id, text] triples) out."""

    kind = "sglang"

    def request_body(self, prompt_ids: list[int], params: SamplingParams) -> dict:
        sampling: dict = {
            "max_new_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1,
            "min_p": params.min_p,
            "ignore_eos": params.ignore_eos,
            "min_new_tokens": params.min_tokens,
            "skip_special_tokens": params.skip_special_tokens,
            # SGLang trims the matched stop string from the text unless told not to.
            "no_stop_trim": params.include_stop_str_in_output,
        }
        optional = {
            "stop": params.stop,
            "stop_token_ids": params.stop_token_ids,
            "repetition_penalty": params.repetition_penalty,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            # SGLang names the per-request seed sampling_seed; it honours it only when
            # launched with deterministic sampling support, otherwise it is ignored.
            "sampling_seed": params.seed,
        }
        sampling.update({k: v for k, v in optional.items() if v is not None})
        sampling.update(params.extra_fields())
        return {"input_ids": list(prompt_ids), "sampling_params": sampling, "return_logprob": True, "stream": False}

    def parse_response(self, base_url: str, body: dict) -> Generation:
        if isinstance(body, list):  # a batch answer to a single prompt
            body = body[0]
        meta = body.get("meta_info") if isinstance(body, dict) else None
        if not isinstance(meta, dict):
            raise BackendError(base_url, f"sglang response has no meta_info: {body!r:.300}", retryable=False)
        triples = meta.get("output_token_logprobs")
        if triples is None:
            raise BackendError(
                base_url, "sglang response has no output_token_logprobs; send return_logprob", retryable=False
            )
        logprobs = [float("-inf") if t[0] is None else float(t[0]) for t in triples]
        token_ids = body.get("output_ids")
        if token_ids is None:
            token_ids = [int(t[1]) for t in triples]
        if len(token_ids) != len(logprobs):
            raise BackendError(base_url, f"{len(token_ids)} output ids but {len(logprobs)} logprobs", retryable=False)
        finish = meta.get("finish_reason")
        finish_type, matched = "stop", None
        if isinstance(finish, dict):
            finish_type = finish.get("type", "stop")
            matched = finish.get("matched")
        elif isinstance(finish, str):
            finish_type = finish
        if finish_type == "abort":
            message = finish.get("message", "aborted") if isinstance(finish, dict) else "aborted"
            raise BackendError(base_url, f"sglang aborted the request: {message}")
        version = meta.get("weight_version")
        try:
            policy_version = int(version) if version is not None else None
        except (TypeError, ValueError):
            policy_version = None
        return Generation(
            token_ids=[int(t) for t in token_ids],
            logprobs=logprobs,
            finish_reason=finish_type,
            text=body.get("text") or "",
            stop_reason=matched,
            prompt_tokens=meta.get("prompt_tokens"),
            cached_tokens=meta.get("cached_tokens"),
            backend=base_url,
            policy_version=policy_version,
        )

    async def generate(
        self, base_url: str, prompt_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> Generation:
        base_url = base_url.rstrip("/")
        body = self.request_body(prompt_ids, params)
        data = await self._request("POST", f"{base_url}/generate", base_url, timeout_s, json=body)
        return self.parse_response(base_url, data)


BackendKind = Literal["vllm", "sglang", "builtin"]


def make_client(kind: BackendKind = "vllm", **kwargs) -> CompletionBackend:
    """The client for a backend kind; the built-in server speaks vLLM's API."""
    if kind in ("vllm", "builtin"):
        return VLLMClient(**kwargs)
    if kind == "sglang":
        return SGLangClient(**kwargs)
    raise ValueError(f"unknown backend kind {kind!r}; use one of 'vllm', 'sglang', 'builtin'")
