"""The built-in server's engine: a transformers causal LM stepped by one background thread.
New requests join at step boundaries (prefilled alone, reusing cached prefixes), then every
active sequence advances one token per step in one padded batch; weights swap between steps."""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from rollstream.llm.server.cache import KV, PrefixCache, kv_length
from rollstream.llm.server.detokenizer import IncrementalText
from rollstream.llm.server.sampling import Choice, LogprobsMode, SequenceSampling, choose_next
from rollstream.llm.transformers_compat import cache_kwargs, output_cache

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request the engine cannot serve (bad ids, too long, bad weights folder)."""


class ContextTooLong(EngineError):
    pass


@dataclass
class EngineConfig:
    model_dir: Path
    device: str = "auto"
    max_batch_size: int = 64
    max_model_len: int | None = None
    prefix_cache_bytes: int = 1 << 30
    logprobs_mode: LogprobsMode = "raw_logprobs"
    served_model_name: str | None = None


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SequenceSampling
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Called on the caller's loop with (token_id, logprob, top_logprobs) as each token is
    # generated: what streams a completion while it is generated.
    on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None


@dataclass
class GenerateResult:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    prompt_tokens: int
    cached_tokens: int
    policy_version: int


@dataclass
class _Sequence:
    request: GenerateRequest
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    prompt: torch.Tensor
    policy_version: int
    kv: KV | None = None
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Stop strings only: the output's text so far, how much of it was searched already, and
    # where matches may end (the text of the first min_tokens ids), found once.
    text: IncrementalText | None = None
    stop_searched: int = 0
    stop_floor: int | None = None

    def kv_ids(self) -> list[int]:
        # The last sampled token has not been through the model yet: its key/value is absent.
        return self.request.prompt_ids + self.output_ids[:-1]


@dataclass
class _WeightSwap:
    source: Path | dict  # a folder of *.safetensors, or CUDA IPC handles
    policy_version: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


def _resolve(
    fut: asyncio.Future, loop: asyncio.AbstractEventLoop, result=None, error: BaseException | None = None
) -> None:
    def _set() -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    try:
        loop.call_soon_threadsafe(_set)
    except RuntimeError:
        pass  # the caller's loop is closed; nobody is waiting


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cache_from(kv: KV | None, config):
    from transformers import DynamicCache

    if not kv:
        return DynamicCache(config=config)
    return DynamicCache(ddp_cache_data=kv, config=config)


def _kv_from(cache) -> KV:
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))  # transformers 4.x


class Engine:
    """Owns the model. `generate` and `load_weights` are awaitable from any event loop; the
    model itself only ever runs on the engine thread."""

    def __init__(self, config: EngineConfig):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.device = pick_device(config.device)
        model_dir = Path(config.model_dir)
        # fp32 on CPU so that logprobs match a recomputation to 1e-4; a GPU takes the
        # checkpoint's own dtype (logprobs are still taken from fp32 logits).
        dtype = torch.float32 if self.device.type == "cpu" else "auto"
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model_name = config.served_model_name or model_dir.name
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.max_model_len = config.max_model_len or int(getattr(self.model.config, "max_position_embeddings", 4096))
        self.eos_ids = self._eos_ids()
        self.prefix_cache = PrefixCache(max_bytes=config.prefix_cache_bytes)
        self.policy_version = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._waiting: list[_Sequence] = []
        self._active: list[_Sequence] = []
        self._swaps: list[_WeightSwap] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.max_batch_seen = 0
        self.generated_tokens = 0

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rollstream-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # ---- API (any thread / loop) -----------------------------------------------------
    def validate(self, req: GenerateRequest) -> None:
        if not req.prompt_ids:
            raise EngineError("prompt is empty; send at least one token id")
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError(f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        total = len(req.prompt_ids) + req.max_tokens
        if total > self.max_model_len:
            raise ContextTooLong(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{total} tokens ({len(req.prompt_ids)} in the messages, {req.max_tokens} in the completion). "
                "Please reduce the length of the messages or completion."
            )

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.validate(req)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        req.sampling.stop_ids = frozenset(req.stop_token_ids) | (frozenset() if req.ignore_eos else self.eos_ids)
        seq = _Sequence(
            request=req, future=fut, loop=loop, prompt=torch.tensor(req.prompt_ids, dtype=torch.long), policy_version=-1
        )
        self._inbox.put(seq)
        self._wake.set()
        return await fut

    async def load_weights(self, source: Path | str | dict, policy_version: int | None = None) -> int:
        """Swap in new weights once the sequences in flight have finished (new requests wait),
        so that no generation mixes two policies. `source`: a folder of *.safetensors (mapped,
        each tensor copied straight into its parameter), or CUDA IPC handles of the trainer's
        tensors on this GPU (weights_transfer.export_cuda_ipc)."""
        if not isinstance(source, dict):
            source = Path(source)
            if not source.is_dir() or not any(source.glob("*.safetensors")):
                raise EngineError(
                    f"no *.safetensors files in {source}; save the policy with "
                    f"model.save_pretrained({str(source)!r}) (a /dev/shm folder is only seen on its host)"
                )
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        version = self.policy_version + 1 if policy_version is None else int(policy_version)
        self._inbox.put(_WeightSwap(source=source, policy_version=version, future=fut, loop=loop))
        self._wake.set()
        return await fut

    def stats(self) -> dict:
        return {
            "policy_version": self.policy_version,
            "active": len(self._active),
            "waiting": len(self._waiting),
            "steps": self.steps,
            "max_batch_seen": self.max_batch_seen,
            "generated_tokens": self.generated_tokens,
            "prefix_cache": self.prefix_cache.stats.as_dict(),
        }

    # ---- engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop.is_set():
                try:
                    self._iterate()
                except Exception as exc:
                    # Fail what is in flight rather than leave callers waiting on a dead thread.
                    logger.exception("engine iteration failed; failing %d requests", len(self._active))
                    for seq in self._active:
                        _resolve(seq.future, seq.loop, error=exc)
                    self._active = []

    def _iterate(self) -> None:
        self._drain_inbox()
        if self._swaps and not self._active:
            self._apply_swaps()
        if not self._swaps:
            self._admit()
        if self._active:
            self._step()
        elif not self._waiting and not self._swaps:
            self._wake.wait(timeout=0.5)
            self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _WeightSwap):
                self._swaps.append(item)
            else:
                self._waiting.append(item)

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.config.max_batch_size:
            seq = self._waiting.pop(0)
            if seq.future.done():  # cancelled while waiting
                continue
            seq.policy_version = self.policy_version
            try:
                self._prefill(seq)
            except Exception as exc:  # one bad request must not stop the engine
                logger.exception("prefill failed")
                _resolve(seq.future, seq.loop, error=exc)
                continue
            if not self._maybe_finish(seq):
                self._active.append(seq)

    def _forward(self, input_ids, position_ids, attention_mask, kv: KV | None):
        cache = _cache_from(kv, self.model.config)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=True,
            logits_to_keep=1,
            **cache_kwargs(self.model, cache),
        )
        return out.logits[:, -1, :], _kv_from(output_cache(out))

    def _prefill(self, seq: _Sequence) -> None:
        prompt = seq.request.prompt_ids
        hit = self.prefix_cache.lookup(prompt)
        start = hit.length if hit else 0
        seq.cached_tokens = start
        ids = torch.tensor([prompt[start:]], dtype=torch.long, device=self.device)
        positions = torch.arange(start, len(prompt), device=self.device).unsqueeze(0)
        mask = torch.ones(1, len(prompt), dtype=torch.long, device=self.device)
        logits, seq.kv = self._forward(ids, positions, mask, hit.kv if hit else None)
        self._accept(seq, logits[0])

    def _step(self) -> None:
        seqs = [s for s in self._active if not s.future.done()]
        self._active = seqs
        if not seqs:
            return
        caches: list[KV] = []
        for s in seqs:
            assert s.kv is not None  # prefilled before it joined the active set
            caches.append(s.kv)
        lengths = [kv_length(c) for c in caches]
        longest = max(lengths)
        num_layers = len(caches[0])
        # Left-pad every cache to the longest; the attention mask hides the padding and
        # explicit position ids keep each sequence's rotary positions its own.
        kv: KV = []
        for layer in range(num_layers):
            keys = [F.pad(c[layer][0], (0, 0, longest - n, 0)) for c, n in zip(caches, lengths)]
            values = [F.pad(c[layer][1], (0, 0, longest - n, 0)) for c, n in zip(caches, lengths)]
            kv.append((torch.cat(keys, 0), torch.cat(values, 0)))
        mask = torch.zeros(len(seqs), longest + 1, dtype=torch.long, device=self.device)
        for row, n in enumerate(lengths):
            mask[row, longest - n :] = 1
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([[n] for n in lengths], dtype=torch.long, device=self.device)
        try:
            logits, new_kv = self._forward(ids, positions, mask, kv)
        except Exception as exc:
            logger.exception("decode step failed for a batch of %d", len(seqs))
            for s in seqs:
                _resolve(s.future, s.loop, error=exc)
            self._active = []
            return
        self.steps += 1
        self.max_batch_seen = max(self.max_batch_seen, len(seqs))
        still: list[_Sequence] = []
        for row, (s, n) in enumerate(zip(seqs, lengths)):
            pad = longest - n
            s.kv = [(k[row : row + 1, :, pad:], v[row : row + 1, :, pad:]) for k, v in new_kv]
            self._accept(s, logits[row])
            if not self._maybe_finish(s):
                still.append(s)
        self._active = still

    def _accept(self, seq: _Sequence, logits: torch.Tensor) -> None:
        out = torch.tensor(seq.output_ids, dtype=torch.long, device=logits.device)
        choice: Choice = choose_next(
            logits, seq.request.sampling, seq.prompt.to(logits.device), out, self.config.logprobs_mode
        )
        seq.output_ids.append(choice.token_id)
        seq.logprobs.append(choice.logprob)
        seq.top_logprobs.append(choice.top_logprobs)
        self.generated_tokens += 1
        if seq.request.on_token is not None:
            try:
                seq.loop.call_soon_threadsafe(
                    seq.request.on_token, choice.token_id, choice.logprob, choice.top_logprobs
                )
            except RuntimeError:
                pass  # the caller's loop is closed; nobody is listening

    def _maybe_finish(self, seq: _Sequence) -> bool:
        """Finish `seq` if its last token ends it; True when it is done."""
        req = seq.request
        if seq.future.done():
            return True
        last = seq.output_ids[-1]
        finish: str | None = None
        stop_reason: int | str | None = None
        text: str | None = None
        if last in req.stop_token_ids:
            finish, stop_reason = "stop", last
        elif not req.ignore_eos and last in self.eos_ids:
            finish = "stop"
        if req.stop:
            if seq.text is None:
                seq.text = IncrementalText(self.tokenizer, req.skip_special_tokens)
            seq.text.catch_up(seq.output_ids)
        if finish is None and req.stop and len(seq.output_ids) > req.sampling.min_tokens:
            assert seq.text is not None
            text = seq.text.text
            if seq.stop_floor is None:
                # As in vLLM, stop strings count only once min_tokens have been generated.
                seq.stop_floor = (
                    len(self.text_of(seq.output_ids[: req.sampling.min_tokens], req)) if req.sampling.min_tokens else 0
                )
            # Only where the newest text can complete a match: the rest was searched before.
            searched, seq.stop_searched = max(seq.stop_floor, seq.stop_searched), len(text)
            hits = [(at, s) for s in req.stop if s for at in [text.find(s, max(0, searched - len(s) + 1))] if at >= 0]
            if hits:
                at, matched = min(hits)
                finish, stop_reason = "stop", matched
                text = text[: at + len(matched)] if req.include_stop_str_in_output else text[:at]
        if finish is None and len(seq.output_ids) >= req.max_tokens:
            finish = "length"
        if finish is None:
            return False
        if text is None:
            # vLLM leaves the stop token (EOS or a stop_token_id) out of the text unless asked.
            stopped_by_token = finish == "stop" and not req.include_stop_str_in_output
            text = self.text_of(seq.output_ids[:-1] if stopped_by_token else seq.output_ids, req)
        if seq.kv is not None:
            self.prefix_cache.insert(seq.kv_ids(), seq.kv)
        result = GenerateResult(
            token_ids=list(seq.output_ids),
            logprobs=list(seq.logprobs),
            top_logprobs=seq.top_logprobs,
            text=text,
            finish_reason=finish,
            stop_reason=stop_reason,
            prompt_tokens=len(req.prompt_ids),
            cached_tokens=seq.cached_tokens,
            policy_version=seq.policy_version,
        )
        seq.kv = None
        _resolve(seq.future, seq.loop, result=result)
        return True

    def text_of(self, ids: list[int], req: GenerateRequest) -> str:
        """The text of `ids` as vLLM's incremental detokenizer leaves it: a character whose
        bytes are not all generated yet is not in it."""
        return self.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens).rstrip("\ufffd")

    def _apply_swaps(self) -> None:
        swaps, self._swaps = self._swaps, []
        for swap in swaps:
            where = swap.source if isinstance(swap.source, Path) else "CUDA IPC handles"
            try:
                count = self._load_state(swap.source)
            except Exception as exc:
                logger.warning("weight load from %s failed: %s", where, exc)
                _resolve(swap.future, swap.loop, error=exc if isinstance(exc, EngineError) else EngineError(str(exc)))
                continue
            self.prefix_cache.clear()
            self.policy_version = swap.policy_version
            logger.info("loaded %d tensors from %s; policy version %d", count, where, swap.policy_version)
            _resolve(swap.future, swap.loop, result=swap.policy_version)

    def _load_state(self, source: Path | dict) -> int:
        """Copy the new tensors into the served model's own parameters (copy_ casts and moves),
        each straight from the mapped file or the trainer's GPU memory, after checking every
        name and shape, so that a wrong or truncated folder changes nothing."""
        from rollstream.llm.weights_transfer import WeightsFileError, cuda_ipc_tensors, mapped_safetensors

        started = time.monotonic()
        own = self.model.state_dict()
        label = source if isinstance(source, Path) else "the CUDA IPC handles"
        try:
            with mapped_safetensors(source) if isinstance(source, Path) else cuda_ipc_tensors(source) as tensors:
                unknown = [k for k in tensors if k not in own]
                if unknown:
                    raise EngineError(
                        f"{label} has tensors this model does not: {unknown[:3]}; is it the same architecture?"
                    )
                wrong = [k for k, t in tensors.items() if tuple(t.shape) != tuple(own[k].shape)]
                if wrong:
                    raise EngineError(f"{label} has tensors of the wrong shape: {wrong[:3]}")
                with torch.no_grad():
                    for key, tensor in tensors.items():
                        own[key].copy_(tensor)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the trainer may reuse its memory once we answer
                count = len(tensors)
        except WeightsFileError as exc:
            raise EngineError(str(exc)) from exc
        logger.debug("weight copy took %.3fs", time.monotonic() - started)
        return count


_request_counter = itertools.count()


def next_request_id() -> str:
    return f"cmpl-{int(time.time())}-{next(_request_counter)}"
