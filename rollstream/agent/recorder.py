"""Exact token ids from a black-box harness: each model call of a job (whichever API it came in)
is turned into prompt ids, and the backend's completion ids and logprobs are recorded unchanged.
A job may have several call chains open at once (a CLI's sub-agents, its side calls such as a
title): a call whose messages extend an open chain's (its last call's messages, then the
assistant reply that call got, then what the harness added) extends that chain: the earlier ids
stay as they were, only the added messages are tokenized (the template's delta, as the built-in
agent loop does), mask 0. Any other call (a new sub-agent, a history rewritten by compaction,
tools changed) starts a new segment and chain, tokenized afresh; so does a call that would extend
a chain another call is extending at that moment (a fork). Model tokens are never re-tokenized,
so decode→encode drift cannot happen by construction."""

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
        return "".join((p.get("text", p.get("refusal", "")) or "") if isinstance(p, dict) else str(p) for p in content)
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


# Open chains kept per job; past it the least recently extended is closed (its segment stays).
MAX_OPEN_CHAINS = 16


@dataclass(eq=False)
class _Open:
    """An open chain: the sequence a later call may extend."""

    messages: list[dict]  # the chain's last call's messages plus the assistant reply it got, normalized
    tools_key: str
    ids: list[int]
    ended_turn: bool
    segment: int  # the index of its segment
    rendered: str | None = None  # the template's text of ``messages`` (see CallRecorder.prepare)
    busy: bool = False  # a call extending it is being generated


@dataclass
class Claim:
    """A call's prompt ids, and the open chain it extends (held for it until it is recorded or
    has failed: ``CallRecorder.release``), or None for a new segment; with the call's renderer
    and normalized messages, which recording it uses again (a harness's tool list can be tens of
    KiB of JSON: its key is made once per call)."""

    prompt_ids: list[int]
    renderer: ChatRenderer
    tools_key: str
    messages: list[dict]  # the call's messages, normalized
    chain: _Open | None = None

    @property
    def extended(self) -> bool:
        return self.chain is not None


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
    chains: list[_Open] = field(default_factory=list)  # least recently extended first
    _renderers: dict[str, ChatRenderer] = field(default_factory=dict)

    def renderer(self, tools: list[dict] | None) -> tuple[ChatRenderer, str]:
        key = json.dumps(tools or [], sort_keys=True)
        if key not in self._renderers:
            self._renderers[key] = ChatRenderer(self.tokenizer, tools or None, self.end_of_turn_token,
                                                self.template_kwargs)
        return self._renderers[key], key

    @staticmethod
    def normalized(messages: list[dict]) -> list[dict]:
        return normalize_messages(messages)

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> Claim:
        """The prompt ids of a call, and the open chain it extends (the longest it extends)."""
        renderer, key = self.renderer(tools)
        norm = normalize_messages(messages)
        self.last_messages = norm
        best: _Open | None = None
        for chain in self.chains:
            if chain.busy or chain.tools_key != key or len(norm) <= len(chain.messages):
                continue
            longer = best is None or len(chain.messages) > len(best.messages)
            if norm[: len(chain.messages)] == chain.messages and longer:
                best = chain
        if best is not None:
            try:
                added = renderer.observation_ids(
                    best.messages, norm[len(best.messages) :], best.ended_turn, before=best.rendered
                )
            except ChatTemplateError:
                pass  # a template that is not prefix-stable here: a new, still exact, segment
            else:
                best.busy = True
                return Claim(best.ids + added, renderer, key, norm, best)
        return Claim(renderer.prompt_ids(norm), renderer, key, norm)

    def release(self, claim: Claim) -> None:
        """The call of ``claim`` is over (recorded or failed): its chain may be extended again."""
        if claim.chain is not None:
            claim.chain.busy = False

    def record(self, claim: Claim, gen: Generation, reply: dict) -> None:
        """Record a call's completion (``reply``: the assistant message returned to the harness)."""
        renderer, key = claim.renderer, claim.tools_key
        prompt_ids = claim.prompt_ids
        chain = claim.chain if claim.chain is not None and claim.chain in self.chains else None
        if chain is not None:
            seg = self.segments[chain.segment]
            added = prompt_ids[len(seg.prompt_ids) + len(seg.response_ids) :]
            seg.response_ids += added
            seg.loss_mask += [0] * len(added)
            seg.logprobs += [0.0] * len(added)
            self.chains.remove(chain)
        else:
            seg = Segment(prompt_ids=list(prompt_ids))
            self.segments.append(seg)
        seg.response_ids += gen.token_ids
        seg.loss_mask += [1] * len(gen.token_ids)
        seg.logprobs += gen.logprobs
        seg.num_calls += 1
        seg.call_indices.append(len(self.calls))
        if gen.policy_version is not None:
            self.versions.append(gen.policy_version)
        ended = bool(gen.token_ids) and gen.token_ids[-1] == renderer.end_of_turn_id
        index = chain.segment if chain is not None else len(self.segments) - 1
        opened = _Open(
            messages=claim.messages + normalize_messages([reply]),
            tools_key=key,
            ids=list(prompt_ids) + list(gen.token_ids),
            ended_turn=ended,
            segment=index,
            busy=chain.busy if chain is not None else False,
        )
        if chain is not None:
            claim.chain = opened  # released through the claim, like the chain it replaces
        self.chains.append(opened)
        idle = [c for c in self.chains if not c.busy]
        if len(self.chains) > MAX_OPEN_CHAINS and idle:
            self.chains.remove(idle[0])
        self.last_messages = opened.messages
        self.calls.append(
            CallRecord(
                segment=index,
                prompt_tokens=len(prompt_ids),
                completion_tokens=len(gen.token_ids),
                backend=gen.backend,
                finish_reason=gen.finish_reason,
                extended=chain is not None,
            )
        )

    def prepare(self) -> None:
        """Render the open chains' messages ahead of their next calls (one of the two renderings
        that extending one takes): the door calls this once its answer is sent, while the
        harness runs its tools, so the next call does not wait for it."""
        for chain in self.chains:
            if chain.rendered is None and not chain.busy:
                renderer = self._renderers[chain.tools_key]
                try:
                    chain.rendered = renderer.render(chain.messages, add_generation_prompt=False)
                except Exception:  # the next call renders it again and says what is wrong
                    chain.rendered = ""

    def trajectory(self) -> Trajectory:
        """The episode: every segment, the last one also in the top-level fields."""
        last = self.segments[-1] if self.segments else Segment()
        traj = Trajectory(
            prompt_ids=list(last.prompt_ids),
            response_ids=list(last.response_ids),
            loss_mask=list(last.loss_mask),
            logprobs=list(last.logprobs),
            num_turns=len(self.calls),
            segments=[s.model_copy() for s in self.segments],
            messages=[
                Message(role=m["role"], content=m["content"], tool_calls=m.get("tool_calls"), name=m.get("name"))
                for m in self.last_messages
            ],
        )
        traj.policy_version = min(self.versions) if self.versions else 0
        if len(set(self.versions)) > 1:
            traj.extra["policy_versions"] = self.versions
        traj.extra["calls"] = [vars(c) for c in self.calls]
        return traj
