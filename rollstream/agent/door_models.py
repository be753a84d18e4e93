"""The requests the per-job door accepts, one typed model per API it speaks (OpenAI Chat
Completions, OpenAI Responses, Anthropic Messages). Each API's module checks the raw JSON first,
field by field, and refuses what it cannot honour with a 400 in that API's words (#29's rule);
what passed is then parsed into its model here, and everything after the edge (the answer's
body, the streamed events) reads the model, not the dict. Fields the door reads are declared;
the client's bookkeeping (user, metadata, service_tier, ...) is typed too (a field the door accepts
is checked even where it changes nothing) and kept as sent."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, SkipValidation, ValidationError, model_validator

from rollstream.agent.door_request import DoorError

# A number as sent: an int stays an int where the door echoes it back (Responses does).
Number = int | float
ToolChoice = Literal["auto", "none"]  # the choices the checks let through for OpenAI's APIs
# The conversation and the tools: their API's checks went through them item by item (each a JSON
# object, in that API's words), so they are typed here and not walked a second time, which would
# cost a copy of every message on every call.
Items = Annotated[list[dict[str, Any]], SkipValidation]


class DoorRequest(BaseModel):
    """What every API's request shares: the model it names (one the job's door serves: the gateway
    answers any other with that API's 404), echoed back, and streaming."""

    model_config = ConfigDict(extra="allow")
    # Fields the checks take as unset when falsy (``"store": 0``, ``"tools": []``): unset here too.
    FALSY_IS_UNSET: ClassVar[tuple[str, ...]] = ("tools", "store")

    model: str | None = None
    stream: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _falsy_is_unset(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(name in data and not data[name] for name in cls.FALSY_IS_UNSET):
            return {k: v for k, v in data.items() if not (k in cls.FALSY_IS_UNSET and not v)}
        return data

    @classmethod
    def accepted(cls, request: dict) -> Any:
        """``request``, already through its API's checks, as this model. The checks refuse first,
        in the API's own words; a value they let through that this model cannot type is still a
        400 naming the field, never a 500."""
        try:
            return cls.model_validate(request)
        except ValidationError as exc:
            error = exc.errors()[0]
            param = ".".join(str(part) for part in error["loc"]) or None
            raise DoorError(400, f"{param}: {error['msg']}", "invalid_value", param=param) from None


class OpenAIBookkeeping(DoorRequest):
    """The client's bookkeeping for OpenAI's own service, in both OpenAI APIs: nothing here asks
    anything of the generation, but each is checked as OpenAI types it."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None


class ChatRequest(OpenAIBookkeeping):
    """POST /v1/chat/completions (door_request.parse_request checks it)."""

    FALSY_IS_UNSET = ("tools", "store", "logit_bias")

    messages: Items
    tools: Items | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    # The job's sampling replaces these (door_request's docstring): numbers, kept as sent.
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Number | None = None
    min_p: Number | None = None


class ResponsesRequest(OpenAIBookkeeping):
    """POST /v1/responses (door_responses.parse checks it). The answer echoes instructions, tools,
    tool_choice, sampling and max_output_tokens back, as the Responses API does."""

    FALSY_IS_UNSET = ("tools", "store", "background", "include")

    input: str | Items
    instructions: str | None = None
    tools: Items | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    store: bool | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    client_metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: None = None
    background: bool | None = None
    truncation: Literal["disabled"] | None = None
    top_logprobs: int | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    stream_options: dict[str, Any] | None = None


class AnthropicRequest(DoorRequest):
    """POST /v1/messages and /v1/messages/count_tokens (door_anthropic.parse checks it)."""

    messages: Items
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = None  # required except to count tokens
    stop_sequences: str | list[str] | None = None
    tools: Items | None = None
    tool_choice: dict[str, Any] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: Number | None = None
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # The client's bookkeeping for Anthropic's service (as Anthropic types it).
    metadata: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    cache_control: dict[str, Any] | None = None
