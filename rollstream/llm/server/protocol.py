"""Request and response bodies of the built-in server: the subset of vLLM's OpenAI-compatible
API that rollstream uses, with vLLM's field names and shapes (so `VLLMClient` talks to either
unchanged), plus the weight-sync endpoints the trainer calls."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CompletionRequest(BaseModel):
    """POST /v1/completions. Unknown vLLM fields are accepted and ignored, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: list[int] | str | list[list[int]] | list[str] = Field(
        ..., description="token ids (preferred) or text; or a batch of either (one choice per prompt and sample)")
    max_tokens: int | None = Field(16, ge=1, description="vLLM's default is 16")
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = Field(None, ge=0, description="number of top logprobs per token; 0 = the sampled one only")
    echo: bool = False
    n: int = Field(1, description="samples per prompt (n > 1 needs temperature > 0, as in vLLM)")
    stream: bool = False
    stream_options: dict | None = Field(None, description='{"include_usage": true} adds a last chunk with usage')
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    # Not in vLLM: the weights version that produced every token of this completion.
    policy_version: int


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "rollstream"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class LoadWeightsRequest(BaseModel):
    path: str | None = Field(None, description="folder with *.safetensors (as written by save_pretrained)")
    cuda_ipc: dict[str, dict[str, Any]] | None = Field(
        None, description="instead of path: CUDA IPC handles of the trainer's tensors on this server's GPU "
                          "(rollstream.llm.weights_transfer.export_cuda_ipc)")
    policy_version: int | None = Field(None, description="version to report from now on; default: current + 1")

    @model_validator(mode="after")
    def _one_source(self) -> LoadWeightsRequest:
        if (self.path is None) == (self.cuda_ipc is None):
            raise ValueError("give exactly one of 'path' (a folder of *.safetensors) and 'cuda_ipc'")
        return self


class WeightsPlacement(BaseModel):
    """Where the server runs, for the trainer's choice of weight transfer (weights_transfer.Placement)."""

    boot_id: str
    shm: str | None
    device: str
    gpu_uuid: str | None = None


class PolicyVersion(BaseModel):
    policy_version: int


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorBody
