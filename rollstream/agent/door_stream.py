"""Streaming through the per-job door (agent/gateway.py): the text of a reply as the backend
generates its tokens, and the HTTP response that carries each API's events as they come.

The text given while a reply streams is never more than the finished reply will be: a character
whose bytes are not all generated yet waits (llm/detokenizer.py's IncrementalText), text
that may be the start of a stop string waits until the next token says it is not, and once a
``<tool_call>`` block starts nothing more is given as text (its call is parsed at the end and sent
in the API's own tool-call form). What was sent is what the reply's content is, so the harness's
next call, which echoes it, extends the recorded sequence."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollstream.agent.parsing import TOOL_CALL_OPEN, ToolCall
from rollstream.llm.detokenizer import IncrementalText

log = logging.getLogger(__name__)


@dataclass
class Completed:
    """A call's answer, whichever API asked: the text the harness gets, the tool calls parsed from
    the model's text, why it ended, and the counts each API reports."""

    content: str
    calls: list[ToolCall]
    finish: str  # "stop", "length" or "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    stop_sequence: str | None = None  # the stop string the backend stopped at, where one did
    tokens: list[tuple[int, float]] = field(default_factory=list)  # the text's ids and logprobs

    def reply(self) -> dict:
        """The assistant message as the chat template shows it (and as the recorder keeps it)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            message["tool_calls"] = [c.as_message() for c in self.calls]
        return message


class Emitter(Protocol):
    """One API's events for one streamed call: each returns the bytes to send (b"" for none)."""

    def start(self, prompt_tokens: int) -> bytes: ...

    def text(self, delta: str, tokens: list[tuple[int, float]]) -> bytes: ...

    def finish(self, done: Completed) -> bytes: ...

    def error(self, status: int, message: str, code: str) -> bytes: ...


def held_prefix(text: str, needles: list[str]) -> int:
    """How many characters at the end of ``text`` may be the start of one of ``needles``."""
    longest = 0
    for needle in needles:
        for k in range(min(len(needle) - 1, len(text)), longest, -1):
            if text.endswith(needle[:k]):
                longest = k
                break
    return longest


class ReplyText:
    """The text of a reply while its tokens arrive (see the module docstring): ``feed`` gives the
    part that can be shown now, ``finish`` the rest once the whole reply is known."""

    def __init__(self, tokenizer: Any, end_of_turn_id: int | None, stops: list[str], tool_calls: bool) -> None:
        self.decoder = IncrementalText(tokenizer, skip_special_tokens=False)
        self.end_of_turn_id = end_of_turn_id
        self.stops = stops
        self.marker = TOOL_CALL_OPEN if tool_calls else None
        self.needles = [*stops, *([self.marker] if self.marker else [])]
        self.longest = max((len(n) for n in self.needles), default=1)
        self.sent = ""
        self.in_call = False
        self.pending: list[tuple[int, float]] = []

    def feed(self, ids: list[int], logprobs: list[float]) -> tuple[str, list[tuple[int, float]]]:
        """New tokens; the text they let through now, with the tokens not yet given with text."""
        for token_id, logprob in zip(ids, logprobs):
            if token_id == self.end_of_turn_id:
                continue  # ends the turn; never text
            self.decoder.append(token_id)
            self.pending.append((token_id, logprob))
        if self.in_call:
            return "", []
        text = self.decoder.text
        limit = len(text)
        search_from = max(0, len(self.sent) - self.longest + 1)
        for needle in self.needles:
            at = text.find(needle, search_from)
            if 0 <= at < limit:
                limit = at
                self.in_call = needle == self.marker
        if self.in_call:
            limit = len(text[:limit].rstrip())  # the content of a reply with calls ends before them
        else:
            limit -= held_prefix(text[:limit], self.needles)
            if self.marker:  # whitespace before a call that may follow is not part of the content
                limit = len(text[:limit].rstrip())
        if limit <= len(self.sent):
            return "", []
        delta = text[len(self.sent):limit]
        self.sent = text[:limit]
        tokens, self.pending = self.pending, []
        return delta, tokens

    def finish(self, content: str) -> tuple[str, list[tuple[int, float]]]:
        """The reply's whole content is ``content``: the part not sent yet, with the tokens left."""
        tokens, self.pending = self.pending, []
        if not content.startswith(self.sent):
            # Cannot happen for a byte-level tokenizer: what was sent is a prefix of the decode.
            log.warning("streamed text is not a prefix of the reply's text; the rest is not sent")
            return "", tokens
        delta, self.sent = content[len(self.sent):], content
        return delta, tokens


class EventStream:
    """A 200 ``text/event-stream`` response in HTTP/1.1 chunks, its head sent with the first event."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.started = False

    async def send(self, data: bytes) -> None:
        if not data:
            return
        out = b"" if self.started else (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                         b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
        self.started = True
        self.writer.write(out + b"%x\r\n%s\r\n" % (len(data), data))
        await self.writer.drain()

    async def end(self) -> None:
        self.writer.write(b"0\r\n\r\n")
        await self.writer.drain()
