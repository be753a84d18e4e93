"""The requests the per-job door accepts, one typed model per API it speaks (OpenAI Chat
Completions, OpenAI Responses, Anthropic Messages). Each API's module checks the raw JSON first,
field by field, and refuses what it cannot honour with a 400 in that API's words (#29's rule);
what passed is then parsed into its model here, and everything after the edge (the answer's
body, the streamed events) reads the model, not the dict. Fields the door reads are declared;
the client's bookkeeping (user, metadata, service_tier, ...) is kept as sent, as extra fields."""

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
    """What every API's request shares: the model it names, echoed back as sent (the door serves
    one model whatever the name), streaming, and extra fields for the client's bookkeeping."""

    model_config = ConfigDict(extra="allow")
    # Fields the checks take as unset when falsy (``"store": 0``, ``"tools": []``): unset here too.
    FALSY_IS_UNSET: ClassVar[tuple[str, ...]] = ("tools", "store")

    model: Any = None
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


class ChatRequest(DoorRequest):
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


    @model_validator(mode="before")
    @classmethod
    def _one_max_tokens(cls, data: Any) -> Any:
        """max_completion_tokens, when sent, is the limit and max_tokens is not read (as
        door_request._max_tokens reads them): not typed either."""
        if isinstance(data, dict) and data.get("max_completion_tokens") is not None and "max_tokens" in data:
            return {k: v for k, v in data.items() if k != "max_tokens"}
        return data


class ResponsesRequest(DoorRequest):
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
    metadata: Any = None  # the client's, echoed back as sent
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
