"""vLLM's /v1/completions semantics for the built-in server, held to vLLM 0.32 by the
differential test (tests/real_vllm/test_vllm_differential.py): request checks with vLLM's
status codes and messages, max_tokens clamped to the room the prompt leaves, several prompts
and n samples per prompt (child seeds seed+i), logprob token names, and the response either
as one body or as server-sent-event chunks sent while the tokens are generated."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from rollstream.llm.detokenizer import IncrementalText
from rollstream.llm.server.engine import ContextTooLong, Engine, EngineError, GenerateRequest, GenerateResult
from rollstream.llm.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from rollstream.llm.server.sampling import GREEDY_EPS, SequenceSampling

# vLLM's --max-logprobs default.
MAX_LOGPROBS = 20


@dataclass
class Sample:
    """One choice of the response: which prompt, which of its n samples, its request."""

    index: int
    prompt_ids: list[int]
    request: GenerateRequest


def _prompts(engine: Engine, prompt) -> list[list[int]]:
    """The request's prompts as id lists: ids, text, a batch of either."""
    if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], (list, str)):
        prompt = [prompt]
    out = []
    for item in prompt:
        ids = engine.tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        if not ids:
            raise EngineError("You must pass at least one prompt")
        out.append([int(t) for t in ids])
    return out


def _check(body: CompletionRequest, max_model_len: int) -> None:
    if body.echo:
        raise EngineError("echo is not supported by the built-in server (rollstream never sends it)")
    if body.n < 1:
        raise EngineError(f"n must be at least 1, got {body.n}.")
    if body.n > 1 and body.temperature is not None and body.temperature < GREEDY_EPS:
        raise EngineError(f"n must be 1 when using greedy sampling, got {body.n}.")
    if body.logprobs is not None and body.logprobs > MAX_LOGPROBS:
        raise EngineError(
            f"Requested sample logprobs of {body.logprobs}, which is greater than max allowed: {MAX_LOGPROBS}"
        )
    max_tokens = body.max_tokens or 16
    if max_tokens > max_model_len:
        raise EngineError(
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens."
        )
    if body.min_tokens > max_tokens:
        raise EngineError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {body.min_tokens}.")


def _room(prompt_ids: list[int], max_tokens: int, max_model_len: int) -> int:
    """max_tokens clamped to what the context leaves, as vLLM does; errors as vLLM words them."""
    if len(prompt_ids) > max_model_len:
        raise ContextTooLong(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
            f"{len(prompt_ids)} input tokens, which exceeds this limit even without any output tokens. "
            "Please reduce the length of the input prompt."
        )
    room = min(max_tokens, max_model_len - len(prompt_ids))
    if room < 1:
        raise EngineError(f"max_tokens must be at least 1, got {room}.")
    return room


def to_samples(engine: Engine, body: CompletionRequest) -> list[Sample]:
    """One engine request per (prompt, sample); EngineError for what vLLM refuses too."""
    _check(body, engine.max_model_len)
    prompts = _prompts(engine, body.prompt)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    samples = []
    for p, prompt_ids in enumerate(prompts):
        max_tokens = _room(prompt_ids, body.max_tokens or 16, engine.max_model_len)
        for i in range(body.n):
            sampling = SequenceSampling(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k if body.top_k is not None and body.top_k > 0 else -1,
                min_p=body.min_p or 0.0,
                repetition_penalty=body.repetition_penalty or 1.0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                min_tokens=body.min_tokens,
                num_top_logprobs=body.logprobs or 0,
                # vLLM gives the n samples of a seeded request the seeds seed, seed+1, ...
                seed=None if body.seed is None else body.seed + i,
            )
            sampling.make_generator(engine.device)
            request = GenerateRequest(
                prompt_ids=prompt_ids,
                max_tokens=max_tokens,
                sampling=sampling,
                stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
            samples.append(Sample(p * body.n + i, prompt_ids, request))
    return samples


class TokenNames:
    """How a logprob entry names a token: 'token_id:N', or its text the way vLLM writes it
    (a byte that only completes a character with the tokens before it is named by the text
    it completes, or '' while the character is still incomplete)."""

    def __init__(self, engine: Engine, as_ids: bool):
        self.tokenizer = engine.tokenizer
        self.as_ids = as_ids

    def __call__(self, token_id: int, before: list[int]) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        text = self.tokenizer.decode([token_id])
        if not text.endswith("\ufffd"):
            return text
        for n in range(1, min(len(before), 4) + 1):
            context = before[-n:]
            whole = self.tokenizer.decode(context + [token_id])
            if whole.endswith("\ufffd"):
                continue
            # Context tokens that were incomplete bytes themselves belong to this character.
            clean = len(context)
            while clean > 0 and self.tokenizer.decode([context[clean - 1]]).endswith("\ufffd"):
                clean -= 1
            prefix = self.tokenizer.decode(context[:clean]) if clean else ""
            common = 0
            for a, b in zip(prefix, whole):
                if a != b:
                    break
                common += 1
            return whole[common:]
        return ""


def _logprobs(names: TokenNames, out: GenerateResult) -> CompletionLogProbs:
    tokens, offsets, top = [], [], []
    offset = 0
    for i, (token_id, lp, alternatives) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        before = out.token_ids[:i]
        name = names(token_id, before)
        tokens.append(name)
        offsets.append(offset)
        offset += len(name)
        entry = {names(alt, before): v for alt, v in alternatives}
        entry[name] = lp  # vLLM always lists the sampled token
        top.append(entry)
    return CompletionLogProbs(text_offset=offsets, token_logprobs=list(out.logprobs), tokens=tokens, top_logprobs=top)


def usage_of(body: CompletionRequest, samples: list[Sample], results: list[GenerateResult]) -> UsageInfo:
    """vLLM counts each prompt once, however many samples it has."""
    prompt_tokens = sum(len(s.prompt_ids) for s in samples if s.index % body.n == 0)
    completion_tokens = sum(len(r.token_ids) for r in results)
    cached = sum(r.cached_tokens for s, r in zip(samples, results) if s.index % body.n == 0)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details={"cached_tokens": cached},
    )


def completion_response(
    engine: Engine, body: CompletionRequest, request_id: str, samples: list[Sample], results: list[GenerateResult]
) -> CompletionResponse:
    names = TokenNames(engine, bool(body.return_tokens_as_token_ids))
    with_ids = bool(body.return_token_ids)
    choices = [
        CompletionChoice(
            index=s.index,
            text=out.text,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            logprobs=_logprobs(names, out) if body.logprobs is not None else None,
            token_ids=out.token_ids if with_ids else None,
            prompt_token_ids=s.prompt_ids if with_ids else None,
        )
        for s, out in zip(samples, results)
    ]
    return CompletionResponse(
        id=request_id,
        model=engine.model_name,
        choices=choices,
        usage=usage_of(body, samples, results),
        policy_version=min(r.policy_version for r in results),
    )


class _StreamedChoice:
    """One choice while it streams: the ids so far, the text already sent, and the token held
    back until the next event says whether it was the last."""

    def __init__(self, engine: Engine, sample: Sample, names: TokenNames):
        self.sample, self.names = sample, names
        self.text = IncrementalText(engine.tokenizer, sample.request.skip_special_tokens)  # and the ids so far
        self.sent_text = ""
        self.offset = 0
        self.pending: tuple[int, float, list[tuple[int, float]]] | None = None
        # Text that may yet turn out to start a stop string is held back, as vLLM does.
        self.holdback = max((len(x) for x in sample.request.stop), default=1) - 1

    def chunk(self, body: CompletionRequest, final: GenerateResult | None) -> dict | None:
        if self.pending is None:
            return None
        token_id, logprob, alternatives = self.pending
        self.pending = None
        before = self.text.ids[:-1]
        if final is None:
            text = self.text.text
            text = text[: max(len(self.sent_text), len(text) - self.holdback)]
            piece = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        else:
            piece = final.text[len(self.sent_text) :]
        self.sent_text += piece
        choice = {
            "index": self.sample.index,
            "text": piece,
            "logprobs": None,
            "finish_reason": final.finish_reason if final else None,
            "stop_reason": final.stop_reason if final else None,
        }
        if body.logprobs is not None:
            name = self.names(token_id, before)
            top = {self.names(alt, before): v for alt, v in alternatives}
            top[name] = logprob
            choice["logprobs"] = {
                "text_offset": [self.offset],
                "token_logprobs": [logprob],
                "tokens": [name],
                "top_logprobs": [top],
            }
            self.offset += len(name)
        if body.return_token_ids:
            choice["prompt_token_ids"] = self.sample.prompt_ids if len(self.text.ids) == 1 else None
            choice["token_ids"] = [token_id]
        return choice


async def stream_chunks(
    engine: Engine, body: CompletionRequest, request_id: str, samples: list[Sample]
) -> AsyncIterator[str]:
    """Server-sent events as vLLM streams a completion, sent as the tokens are generated: a
    chunk per token of each choice (the first naming the prompt ids, the last with the finish
    reason), then usage if asked for (stream_options.include_usage), then [DONE]."""
    created = int(time.time())
    names = TokenNames(engine, bool(body.return_tokens_as_token_ids))
    events: asyncio.Queue = asyncio.Queue()
    choices = [_StreamedChoice(engine, s, names) for s in samples]
    for number, s in enumerate(samples):
        s.request.on_token = lambda *token, number=number: events.put_nowait((number, token))
    tasks = [asyncio.ensure_future(engine.generate(s.request)) for s in samples]

    def finished(number: int) -> Callable[[asyncio.Task], None]:
        return lambda done: events.put_nowait((number, done))

    for number, task in enumerate(tasks):
        task.add_done_callback(finished(number))

    def event(chunk_choices: list[dict], **extra) -> str:
        chunk = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": engine.model_name,
            "choices": chunk_choices,
            **extra,
        }
        return f"data: {json.dumps(chunk)}\n\n"

    results: list[GenerateResult | None] = [None] * len(samples)
    try:
        while any(r is None for r in results):
            number, item = await events.get()
            streamed = choices[number]
            if isinstance(item, asyncio.Future):
                results[number] = item.result()
                final = streamed.chunk(body, results[number])
            else:
                final = streamed.chunk(body, None)  # the token before this one was not the last
                streamed.pending = item
                streamed.text.append(item[0])
            if final is not None:
                yield event([final])
    finally:
        for task in tasks:
            task.cancel()  # a client that went away frees its batch slots
    if (body.stream_options or {}).get("include_usage"):
        generated = [r for r in results if r is not None]  # every one, once the loop ended
        # As the whole body's: the weights version that produced every token (not in vLLM).
        yield event(
            [],
            usage=usage_of(body, samples, generated).model_dump(),
            policy_version=min(r.policy_version for r in generated),
        )
    yield "data: [DONE]\n\n"
