"""Settings of an agent episode (the run stage's agent loop): turn, token, context and
wall-time limits, the sampling parameters of each model turn and the finish tool. One object
per job, built by the run stage from the job's overrides (``Job.agent``, an
``AgentOverrides``) and its sampling; at the bottom layer, beside the messages."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, with_config
from typing_extensions import TypedDict

from rollstream.sampling import SamplingParams


class AgentSettings(BaseModel):
    """Limits and knobs of one agent episode; every field is documented for the CLI."""

    max_turns: int = Field(16, ge=1, description="Model turns before the episode ends with 'max_turns'.")
    max_tokens_per_turn: int = Field(1024, ge=1, description="Most tokens the model may generate in one turn.")
    max_context_tokens: int = Field(
        32768, ge=16, description="Prompt plus response tokens; past it the episode ends with 'context'."
    )
    max_wall_time_s: float = Field(1800.0, gt=0, description="Wall time of the whole episode ('timeout').")
    tool_timeout_s: float = Field(
        600.0, gt=0, description="Wall time of one tool call; past it the model sees an error observation."
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Wall time of one model request to a backend.")
    max_backend_attempts: int = Field(
        3, ge=1, description="Backends one turn may try when backends fail (each failure ejects one)."
    )
    backend_wait_s: float = Field(
        120.0, ge=0, description="How long a turn waits for a backend when none is healthy (all ejected or "
        "restarting) before the job fails and is retried."
    )
    sampling: SamplingParams = Field(
        default_factory=SamplingParams, description="Sampling of each turn; max_tokens is set per turn."
    )
    finish_tool_names: list[str] = Field(
        default_factory=lambda: ["submit", "finish"],
        description="Tool names that end the episode; their arguments become the answer.",
    )
    add_finish_tool: bool = Field(
        True, description="Offer a 'submit' tool (answer: string) when the tool box has no finish tool."
    )
    max_observation_chars: int = Field(
        16000, ge=100, description="Longer tool outputs keep their head and tail around a marker."
    )
    end_of_turn_token: str | None = Field(
        None, description="Token that ends an assistant turn (default: the tokenizer's eos, <|im_end|> for Qwen)."
    )
    chat_template_kwargs: dict = Field(
        default_factory=dict, description="Extra chat-template variables, e.g. {'enable_thinking': false}."
    )


@with_config(ConfigDict(extra="forbid"))  # a misspelt knob is refused
class AgentOverrides(TypedDict, total=False):
    """What a job may set of its agent (``Job.agent``): any ``AgentSettings`` field but
    ``sampling`` (the job's own ``sampling`` is used), and ``harness``, the name of an agent
    harness that runs the episode instead of the built-in loop (rollstream/agent/harness.py).
    A mapping, not a model: it travels as the submitter wrote it, and each field's bounds are
    checked where the run stage builds the ``AgentSettings``."""

    harness: str
    max_turns: int
    max_tokens_per_turn: int
    max_context_tokens: int
    max_wall_time_s: float
    tool_timeout_s: float
    request_timeout_s: float
    max_backend_attempts: int
    backend_wait_s: float
    finish_tool_names: list[str]
    add_finish_tool: bool
    max_observation_chars: int
    end_of_turn_token: str | None
    chat_template_kwargs: dict


def agent_settings(overrides: AgentOverrides, sampling: SamplingParams) -> AgentSettings:
    """The settings of a job's episode: its overrides over the defaults, with its sampling."""
    return AgentSettings.model_validate({**overrides, "sampling": sampling})
