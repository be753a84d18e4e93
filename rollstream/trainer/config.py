"""The trainer's settings in one place: a TrainConfig read from TOML (`rollstream train
CONFIG.toml`), with a documented default for every field. Nested tables: [sampler], [loss],
[optim], [[backends]]."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollstream.trainer.sampler import SamplerConfig
from rollstream.trainer.weight_sync import BackendSpec


class LossConfig(BaseModel):
    """DAPO's objective (trainer/loss.py)."""

    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="epsilon_low: ratio clipped below at 1 - clip_low")
    clip_high: float = Field(
        0.28, ge=0.0, description="epsilon_high (clip-higher): ratio clipped above at 1 + clip_high"
    )
    tis_cap: float | None = Field(
        None, gt=0.0, description="truncated importance sampling cap C for trainer/rollout mismatch; None = off"
    )
    kl_coef: float = Field(0.0, ge=0.0, description="weight of the k3 KL to the initial policy; 0 = no reference model")
    advantage_eps: float = Field(1e-6, gt=0.0, description="added to the group std before dividing")
    max_response_tokens: int | None = Field(
        None, ge=1, description="overlong shaping L_max (response tokens); None = no shaping"
    )
    overlong_buffer_tokens: int = Field(0, ge=0, description="overlong shaping L_cache: the soft-penalty zone")
    overlong_penalty_factor: float = Field(1.0, ge=0.0, description="scale of the overlong penalty")


class OptimConfig(BaseModel):
    """AdamW and how a batch is cut into optimizer steps."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-6, gt=0.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, gt=0.0, description="gradient clipping by global norm")
    micro_batch_size: int = Field(
        8, ge=1, description="sequences per forward/backward, packed into one row (memory bound)"
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="also close a micro-batch before it passes this many tokens (None: sequences only)"
    )
    logprob_chunk_tokens: int = Field(
        1024, ge=1, description="tokens whose [chunk, vocab] logits are computed at once for the chosen-token logprobs"
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="optimizer steps per batch; >1 reuses rollouts off-policy (ratios against recomputed old logprobs)",
    )
    max_seq_len: int = Field(4096, ge=8, description="prompt + response tokens; longer responses are cut at the end")


class TrainConfig(BaseModel):
    """Everything `rollstream train` needs. Paths are relative to the TOML file's folder."""

    model_config = ConfigDict(extra="forbid")

    model_dir: Path = Field(..., description="transformers causal LM + tokenizer folder (from_pretrained)")
    task: str = Field(..., description="registered task name (rollstream.tasks), e.g. 'arith'")
    prompts_file: Path = Field(..., description="JSONL: one task instance (a JSON object) per line")
    output_dir: Path = Field(Path("runs/train"), description="checkpoints, weights, metrics.jsonl, reward_curve.png")
    steps: int = Field(100, ge=1, description="training steps (batches)")
    seed: int = 0
    device: str = Field("auto", description="'auto' (cuda if available), 'cpu', 'cuda', 'cuda:1', ...")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="parameter dtype of the trained model"
    )

    redis_url: str | None = Field(None, description="rollstream's Redis; None = REDIS_URL / settings")
    namespace: str = "rs"
    submitter: str = Field("trainer", description="names this trainer's results stream")

    sampling: dict[str, Any] = Field(
        default_factory=lambda: {"temperature": 1.0, "max_tokens": 256},
        description="sampling params sent with each job (messages.SamplingParams)",
    )
    agent: dict[str, Any] = Field(default_factory=dict, description="agent-loop overrides sent with each job")
    job_timeout_s: float = Field(600.0, gt=0)

    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    backends: list[BackendSpec] = Field(
        default_factory=list,
        description="servers to publish weights to; empty = every backend registered in Redis (builtin)",
    )
    sync_every_steps: int = Field(1, ge=1, description="publish weights every N steps")
    keep_weight_versions: int = Field(2, ge=1)
    weights_transfer: Literal["auto", "cuda_ipc", "shm", "disk"] = Field(
        "auto",
        description="how weights reach the built-in servers: auto picks per sync from where each one runs "
        "(same GPU: cuda_ipc; same host: shm, a /dev/shm folder; else disk, OUTPUT/weights)",
    )
    checkpoint_every_steps: int = Field(10, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    resume: bool = Field(True, description="continue from the newest checkpoint in output_dir if there is one")
    progress: bool = Field(True, description="live progress view (rich) on a terminal")

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.optim.mini_batches > self.sampler.groups_per_batch * self.sampler.group_size:
            raise ValueError(
                "optim.mini_batches cannot exceed the sequences in a batch (groups_per_batch * group_size)"
            )
        return self

    @classmethod
    def from_toml(cls, path: Path | str, **overrides: Any) -> TrainConfig:
        """Read a TOML file; relative paths resolve against its folder. Top-level keys or a
        [trainer] table both work, so the file can be shared with other components."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"no train config at {path}; see README 'Training' for an example") from exc
        data = data.get("trainer", data)
        data.update(overrides)
        config = cls.model_validate(data)
        base = path.parent
        for name in ("model_dir", "prompts_file", "output_dir"):
            value = getattr(config, name)
            if not value.is_absolute():
                setattr(config, name, (base / value).resolve())
        return config
