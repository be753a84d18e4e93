"""How a model turn samples (SamplingParams): part of every job (``Job.sampling``), of the agent
settings and of each request the LLM clients send. Beside the messages at the bottom layer, so
that the job's vocabulary does not load the HTTP client."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    """Sampling parameters, named as vLLM names them. Fields left None are not sent, so the
    server's defaults apply; unknown extra fields are passed through to the server as is."""

    model_config = ConfigDict(extra="allow")

    max_tokens: int = Field(256, ge=1, description="most tokens to generate this turn")
    temperature: float = Field(1.0, ge=0.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 (or 0) disables top-k")
    min_p: float = 0.0
    seed: int | None = Field(None, description="per-request sampling seed")
    stop: list[str] | None = Field(None, description="stop strings (text is cut before them)")
    stop_token_ids: list[int] | None = Field(None, description="ids that end generation besides EOS")
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def extra_fields(self) -> dict:
        return dict(self.model_extra or {})
