"""Exact token ids from a black-box harness: each chat-completions call of a job is turned into
prompt ids, and the backend's completion ids and logprobs are recorded unchanged. A call whose
messages extend the previous call's (its messages, then the assistant reply it got, then
what the harness added) extends that sequence: the earlier ids stay as they were, only the
added messages are tokenized (the template's delta, as the built-in agent loop does), mask 0.
Any other call (history rewritten, tools changed) starts a new segment, tokenized afresh.
Model tokens are never re-tokenized, so decode→encode drift cannot happen by construction."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rollstream.agent.chat import ChatRenderer, ChatTemplateError
from rollstream.llm.inference_client import Generation
from rollstream.trajectory import Message, Segment, Trajectory


def _text(content: Any) -> str:
    """OpenAI message content (a string, None, or a list of parts) as the template's text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", p.get("refusal", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            return raw  # kept as the harness sent it; the template renders it as text
    return raw


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as the chat template takes them (and as calls are compared):
    text content, tool calls with their arguments as objects, 'developer' as 'system'."""
    out = []
    for m in messages:
        role = m.get("role", "user")
        norm: dict = {"role": "system" if role == "developer" else role, "content": _text(m.get("content"))}
        calls = m.get("tool_calls")
        if calls:
            norm["tool_calls"] = [{"type": "function", "function": {
                "name": c.get("function", {}).get("name", ""),
                "arguments": _arguments(c.get("function", {}).get("arguments", {}))}} for c in calls]
        if role == "tool" and m.get("name"):
            norm["name"] = m["name"]
        out.append(norm)
    return out


@dataclass
class CallRecord:
    """One model call through the door, for the trajectory's bookkeeping."""

    segment: int
    prompt_tokens: int
    completion_tokens: int
    backend: str
    finish_reason: str
    extended: bool


@dataclass
class _Open:
    """The sequence the next call may extend."""

    messages: list[dict]  # the call's messages plus the assistant reply it got, normalized
    tools_key: str
    ids: list[int]
    ended_turn: bool
    rendered: str | None = None  # the template's text of ``messages`` (see CallRecorder.prepare)


@dataclass
class CallRecorder:
    """Turns one job's calls into exact segments (see module docstring)."""

    tokenizer: Any
    end_of_turn_token: str | None = None
    template_kwargs: dict = field(default_factory=dict)
    segments: list[Segment] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    last_messages: list[dict] = field(default_factory=list)
    _open: _Open | None = None
    _renderers: dict[str, ChatRenderer] = field(default_factory=dict)

    def renderer(self, tools: list[dict] | None) -> tuple[ChatRenderer, str]:
        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools or None, self.end_of_turn_token,
                                                self.template_kwargs)
        return self._renderers[key], key

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], bool]:
        """The prompt ids of a call, and whether it extends the open segment."""
        renderer, key = self.renderer(tools)
        norm = normalize_messages(messages)
        self.last_messages = norm
        prev = self._open
        if prev is not None and prev.tools_key == key and len(norm) > len(prev.messages) \
                and norm[:len(prev.messages)] == prev.messages:
            try:
                added = renderer.observation_ids(prev.messages, norm[len(prev.messages):], prev.ended_turn,
                                                 before=prev.rendered)
                return prev.ids + added, True
            except ChatTemplateError:
                pass  # a template that is not prefix-stable here: a new, still exact, segment
        return renderer.prompt_ids(norm), False

    def record(self, messages: list[dict], tools: list[dict] | None, prompt_ids: list[int], extended: bool,
               gen: Generation, reply: dict) -> None:
        """Record a call's completion (``reply``: the assistant message returned to the harness)."""
        renderer, key = self.renderer(tools)
        if extended:
            seg = self.segments[-1]
            added = prompt_ids[len(seg.prompt_ids) + len(seg.response_ids):]
            seg.response_ids += added
            seg.loss_mask += [0] * len(added)
            seg.logprobs += [0.0] * len(added)
        else:
            seg = Segment(prompt_ids=list(prompt_ids))
            self.segments.append(seg)
        seg.response_ids += gen.token_ids
        seg.loss_mask += [1] * len(gen.token_ids)
        seg.logprobs += gen.logprobs
        seg.num_calls += 1
        if gen.policy_version is not None:
            self.versions.append(gen.policy_version)
        ended = bool(gen.token_ids) and gen.token_ids[-1] == renderer.end_of_turn_id
        self._open = _Open(messages=normalize_messages(messages) + normalize_messages([reply]), tools_key=key,
                           ids=list(prompt_ids) + list(gen.token_ids), ended_turn=ended)
        self.last_messages = self._open.messages
        self.calls.append(CallRecord(segment=len(self.segments) - 1, prompt_tokens=len(prompt_ids),
                                     completion_tokens=len(gen.token_ids), backend=gen.backend,
                                     finish_reason=gen.finish_reason, extended=extended))

    def prepare(self) -> None:
        """Render the open sequence's messages ahead of the next call (one of the two
        renderings that extending it takes): the door calls this once its answer is sent,
        while the harness runs its tools, so the next call does not wait for it."""
        prev = self._open
        if prev is not None and prev.rendered is None:
            renderer = self._renderers[prev.tools_key]
            try:
                prev.rendered = renderer.render(prev.messages, add_generation_prompt=False)
            except Exception:  # the next call renders it again and says what is wrong
                prev.rendered = None

    def trajectory(self) -> Trajectory:
        """The episode: every segment, the last one also in the top-level fields."""
        last = self.segments[-1] if self.segments else Segment()
        traj = Trajectory(prompt_ids=list(last.prompt_ids), response_ids=list(last.response_ids),
                          loss_mask=list(last.loss_mask), logprobs=list(last.logprobs),
                          num_turns=len(self.calls), segments=[s.model_copy() for s in self.segments],
                          messages=[Message(role=m["role"], content=m["content"], tool_calls=m.get("tool_calls"),
                                            name=m.get("name")) for m in self.last_messages])
        traj.policy_version = min(self.versions) if self.versions else 0
        if len(set(self.versions)) > 1:
            traj.extra["policy_versions"] = self.versions
        traj.extra["calls"] = [vars(c) for c in self.calls]
        return traj
