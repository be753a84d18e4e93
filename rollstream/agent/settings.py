"""Settings of the agent loop (run stage): turn, token, context and wall-time limits, the
sampling parameters of each model turn and the finish tool. One object per job."""

from __future__ import annotations

from pydantic import BaseModel, Field

from rollstream.llm.client import SamplingParams


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
