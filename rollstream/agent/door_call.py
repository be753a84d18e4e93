"""One job's door (agent/gateway.py serves it over HTTP): whichever API a harness speaks, its
call arrives here as CallOptions (messages and tools as the chat template takes them), is
rendered with the served model's chat template, generated token-in/token-out through the job's
LLM session (streamed to the harness as the tokens come, where it asked), its tool-call text
parsed, and recorded exactly (agent/recorder.py)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollstream.agent.door_request import MODEL_NAME, CallOptions, DoorError, cut_at_stop
from rollstream.agent.door_stream import Completed, Emitter, ReplyText
from rollstream.agent.parsing import reply_calls
from rollstream.agent.recorder import CallRecorder
from rollstream.episode_settings import AgentSettings
from rollstream.llm.balancer import NoBackendAvailable
from rollstream.llm.inference_client import BackendError, ContextLengthError

Send = Callable[[bytes], Awaitable[None]]


@dataclass
class JobDoor:
    """One job's door: its LLM session, limits and the recorder of its calls."""

    job_id: str
    session: Any  # agent.session.LLMSession
    tokenizer: Any
    settings: AgentSettings
    key: str = field(default_factory=lambda: "rs-" + secrets.token_urlsafe(32))
    # The model names the door serves (GET /v1/models lists them): the name presets render as {model}.
    # A call naming another is refused as the APIs refuse a model they do not serve (404).
    models: tuple[str, ...] = (MODEL_NAME,)
    recorder: CallRecorder = field(init=False)
    # Why the episode ended, where the door refused the last call: "context", "max_turns", or
    # "error" (the backends failed it: the service's failure, not the agent's). Cleared by a
    # call that succeeds after it.
    ended: str | None = None
    ended_detail: str | None = None
    llm_s: float = 0.0
    requests: int = 0  # model calls (any API) that reached this door with its key
    refused: int = 0  # of those, answered with an error
    in_flight: int = 0  # requests being served (the gateway caps them per door)
    calling: int = 0  # model calls being served (they count against max_turns already)

    def __post_init__(self) -> None:
        self.recorder = CallRecorder(self.tokenizer, self.settings.end_of_turn_token,
                                     dict(self.settings.chat_template_kwargs))

    async def call(self, options: CallOptions, emitter: Emitter | None = None, send: Send | None = None) -> Completed:
        """Serve one model call. With ``emitter`` and ``send`` it streams: the emitter's events are
        sent as the tokens come (after the checks that answer with an HTTP error)."""
        self.requests += 1
        try:
            return await self._call(options, emitter, send)
        except DoorError:
            self.refused += 1
            raise

    async def count_tokens(self, options: CallOptions) -> int:
        """The prompt's length in tokens, as a call with ``options`` would send it."""
        try:
            return len(self.recorder.renderer(options.tools)[0].prompt_ids(
                self.recorder.normalized(options.messages)))
        except Exception as exc:
            raise _unrenderable(exc) from exc

    async def _call(self, options: CallOptions, emitter: Emitter | None, send: Send | None) -> Completed:
        s = self.settings
        if len(self.recorder.calls) + self.calling >= s.max_turns:
            self._end("max_turns", f"{s.max_turns} model calls used")
            # Permanent (4xx, not 429): every client retries a 429 as a rate limit, and no retry
            # can succeed. The harness's giving up on it is scored as the agent's end.
            raise DoorError(400, f"this job's budget of {s.max_turns} model calls is used up; no further call "
                            "will be served", "max_turns_exceeded")
        self.calling += 1  # counted from here: concurrent calls cannot pass the budget together
        try:
            return await self._serve(options, emitter, send)
        finally:
            self.calling -= 1

    async def _serve(self, options: CallOptions, emitter: Emitter | None, send: Send | None) -> Completed:
        s = self.settings
        tools = options.tools
        try:
            claim = self.recorder.prompt(options.messages, tools)
        except Exception as exc:  # the harness's messages do not render with this template
            raise _unrenderable(exc) from exc
        prompt_ids, renderer = claim.prompt_ids, claim.renderer
        try:
            budget = s.max_context_tokens - len(prompt_ids)
            if budget <= 0:
                self._end("context", f"a {len(prompt_ids)}-token prompt fills the {s.max_context_tokens}-token "
                          "context")
                # Worded as Anthropic words it: Claude Code compacts its history on "prompt is too long".
                raise DoorError(400, f"prompt is too long: {len(prompt_ids)} tokens > {s.max_context_tokens} maximum "
                                "(this model's context for the job)", "context_length_exceeded", param="messages")
            max_tokens = max(1, min(options.max_tokens or s.max_tokens_per_turn, s.max_tokens_per_turn, budget))
            stop_ids = sorted(set(s.sampling.stop_token_ids or []) | {renderer.end_of_turn_id})
            stops = list(dict.fromkeys([*(s.sampling.stop or []), *options.stop]))
            # The job's sampling rules (the trainer's, e.g. temperature 1.0): the harness's own
            # temperature or top_p would make the recorded logprobs off-policy. A seed does not
            # change the distribution: the request's is used where the job sets none.
            update: dict[str, Any] = {"max_tokens": max_tokens, "stop_token_ids": stop_ids, "stop": stops or None}
            if s.sampling.seed is None and options.seed is not None:
                update["seed"] = options.seed
            params = s.sampling.model_copy(update=update)
            stream = ReplyText(self.tokenizer, renderer.end_of_turn_id, stops, options.parse_tool_calls) \
                if emitter is not None else None
            on_tokens = None
            if emitter is not None and send is not None and stream is not None:
                await send(emitter.start(len(prompt_ids)))

                async def on_tokens(ids: list[int], logprobs: list[float]) -> None:
                    delta, tokens = stream.feed(ids, logprobs)
                    if delta:
                        await send(emitter.text(delta, tokens))

            t0 = time.monotonic()
            try:
                gen = await self.session.generate(prompt_ids, params, on_tokens, release_later=True)
            except ContextLengthError as exc:
                self._end("context", exc.reason)
                raise DoorError(400, exc.reason, "context_length_exceeded") from None
            except (BackendError, NoBackendAvailable) as exc:
                self._end("error", str(exc))
                raise DoorError(502, f"no backend could serve this call: {exc}", "backend_unavailable",
                                "server_error") from None
            finally:
                self.llm_s += time.monotonic() - t0
            if len(gen.token_ids) != len(gen.logprobs):
                self._end("error", f"backend returned {len(gen.token_ids)} ids but {len(gen.logprobs)} logprobs")
                raise DoorError(502, "the backend's answer was inconsistent", "backend_error", "server_error")
            ended_turn = bool(gen.token_ids) and gen.token_ids[-1] == renderer.end_of_turn_id
            text_ids = gen.token_ids[:-1] if ended_turn else gen.token_ids
            text = self.tokenizer.decode(text_ids, skip_special_tokens=False)
            stop_sequence = None
            if stops and gen.finish_reason == "stop" and gen.token_ids and gen.token_ids[-1] not in stop_ids:
                # Ended on a stop string: the ids (all recorded) end with the token that completed
                # it; the harness gets the text before it, as vLLM returns it.
                start = len(self.tokenizer.decode(gen.token_ids[:s.sampling.min_tokens], skip_special_tokens=False)) \
                    if s.sampling.min_tokens else 0
                cut = cut_at_stop(text, stops, s.sampling.include_stop_str_in_output, start)
                if cut is not None:
                    text = cut
                    stop_sequence = gen.stop_reason if isinstance(gen.stop_reason, str) else None
            parsed = reply_calls(text) if options.parse_tool_calls else None
            content, calls = parsed if parsed else (text, [])
            if calls and not options.parallel_tool_calls:
                calls = calls[:1]  # as vLLM: the first call only (the ids keep what the model wrote)
            finish = "tool_calls" if calls else "length" if not ended_turn and gen.finish_reason == "length" else "stop"
            done = Completed(content=content, calls=calls, finish=finish, prompt_tokens=len(prompt_ids),
                             completion_tokens=len(gen.token_ids), cached_tokens=gen.cached_tokens or 0,
                             stop_sequence=stop_sequence,
                             tokens=list(zip(text_ids, gen.logprobs)))
            delta, tokens = stream.finish(content) if stream is not None else ("", [])
            if stream is not None:
                done.content = stream.sent  # what the harness has, so that its next call extends this one
            self.recorder.record(claim, gen, done.reply())
        finally:
            self.recorder.release(claim)
        if delta and emitter is not None and send is not None:
            await send(emitter.text(delta, tokens))
        self.ended = self.ended_detail = None  # a harness that got past a refusal (e.g. summarised) goes on
        # Once this answer is on its way (the next turn of the loop), get the next call's
        # rendering ready while the harness works.
        asyncio.get_running_loop().call_soon(self.recorder.prepare)
        if emitter is not None and send is not None:
            await send(emitter.finish(done))
        return done

    async def settle(self) -> None:
        """After a call's answer is sent: give back the backend slot its generation held."""
        await self.session.release_finished()

    def _end(self, reason: str, detail: str) -> None:
        self.ended, self.ended_detail = reason, detail


def _unrenderable(exc: Exception) -> DoorError:
    return DoorError(400, f"the messages cannot be rendered with the model's chat template: {exc}",
                     "invalid_messages", param="messages")
