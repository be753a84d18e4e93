"""verl's agent loop backed by rollstream: ``RollstreamAgentLoop`` (registered as
"rollstream") turns each verl sample into one rollstream job, awaits its result and returns
verl's ``AgentLoopOutput``. verl keeps training; sandboxes, tools and scoring run in rollstream."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

try:
    from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
except ImportError as exc:  # an optional extra: say how to get it
    raise ImportError(
        f"rollstream.integrations.verl needs verl ({exc}); install it with 'pip install rollstream[verl]' "
        "or see the README section 'Use it from your trainer → verl'") from exc

from rollstream.config import Settings, load_settings
from rollstream.errors import RollstreamError
from rollstream.integrations.verl_mapping import VerlSample, build_job, failed_sample, segment_samples
from rollstream.integrations.verl_results import shared_router
from rollstream.messages import Result, new_id

log = logging.getLogger(__name__)

AGENT_NAME = "rollstream"


class RolloutFailed(RollstreamError):
    """rollstream gave up on a sample's job (after its own retries)."""


class VerlLoopConfig(BaseSettings):
    """Settings of the rollstream agent loop. Each comes from the agent-loop YAML entry
    (keys beside ``name``/``_target_``), else the environment (``ROLLSTREAM_VERL_*``; the
    Redis URL and namespace as everywhere in rollstream: ``REDIS_URL``, ``ROLLSTREAM_NAMESPACE``)."""

    model_config = SettingsConfigDict(env_prefix="ROLLSTREAM_VERL_", extra="ignore")

    redis_url: str | None = Field(None, description="Redis of the rollstream deployment (default: REDIS_URL).")
    namespace: str | None = Field(None, description="rollstream namespace (default: ROLLSTREAM_NAMESPACE or 'rs').")
    task: str | None = Field(None, description="Task for rows whose extra_info.rollstream names none.")
    on_failure: Literal["raise", "zero_reward"] = Field(
        "raise", description="A job rollstream could not complete: 'raise' fails verl's step with the job's "
        "error; 'zero_reward' returns an empty response with reward 0 (nothing enters the loss).")
    infrastructure_resubmits: int = Field(
        2, ge=0, description="A job the service failed (sandbox, backend, worker; rollstream already retried it "
        "max_deliveries times) is submitted anew this many times; then the step fails. Such a sample is never "
        "scored 0: verl cannot drop one sample, so it gets a real rollout or none.")
    timeout_s: float = Field(3600.0, gt=0, description="Job timeout inside rollstream (time at work in its "
                             "stages; queue time does not count).")
    wait_timeout_s: float | None = Field(None, gt=0, description="How long run() waits for a result before "
                                         "cancelling the job (default: timeout_s + 300).")
    max_tokens_per_turn: int | None = Field(None, ge=1, description="Tokens per model turn "
                                            "(default: rollout.response_length).")
    agent: dict[str, Any] = Field(default_factory=dict, description="Agent overrides for every job "
                                  "(max_turns, tool_timeout_s, ...); a row's own agent overrides win.")
    sandbox: dict[str, Any] | None = Field(None, description="Sandbox spec overrides for every job.")
    submitter_prefix: str = Field("verl", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$",
                                  description="Prefix of this process's results stream name: 1 to 64 "
                                  "letters, digits, '_', '.' or '-', starting with a letter or digit.")

    def rollstream_settings(self) -> Settings:
        return load_settings(redis_url=self.redis_url, namespace=self.namespace)


def _plain_config(options: dict[str, Any]) -> dict[str, Any]:
    """hydra hands YAML values over as DictConfig/ListConfig; pydantic wants plain ones."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return options
    return {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig | ListConfig) else v
            for k, v in options.items()}


@register(AGENT_NAME)
class RollstreamAgentLoop(AgentLoopBase):
    """One verl sample = one rollstream job. verl builds this object per sample through
    ``hydra.utils.instantiate`` with its own arguments plus the YAML entry's keys; the
    keys this loop knows are ``VerlLoopConfig``'s fields."""

    def __init__(self, *args: Any, **kwargs: Any):
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in VerlLoopConfig.model_fields}
        kwargs.pop("name", None)  # the registry entry's own name
        super().__init__(*args, **kwargs)
        self.loop_config = VerlLoopConfig(**_plain_config(options))
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

    def agent_defaults(self) -> dict[str, Any]:
        """Limits that keep rollstream's episode within what verl can hold: the whole
        sequence fits prompt_length + response_length."""
        defaults = {"max_context_tokens": self.prompt_length + self.response_length,
                    "max_tokens_per_turn": self.loop_config.max_tokens_per_turn or self.response_length}
        max_assistant_turns = (self.rollout_config.get("multi_turn") or {}).get("max_assistant_turns")
        if max_assistant_turns:  # verl's own turn limit, when set, bounds rollstream's too
            defaults["max_turns"] = int(max_assistant_turns)
        return defaults

    # verl's v1 worker takes a list per rollout; its AgentLoopBase still declares one output.
    async def run(  # type: ignore[override]
            self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput | list[AgentLoopOutput]:
        """The sample's rollout. Under verl's v1 trainer (its worker passes ``session_id`` and takes
        several outputs per rollout) a job of several segments gives one output per segment, the
        top-level one last; under the legacy worker, which takes one, the top-level sequence."""
        cfg = self.loop_config
        job = build_job(kwargs, sampling_params, default_task=cfg.task, agent_defaults=self.agent_defaults(),
                        agent_overrides=cfg.agent, sandbox=cfg.sandbox, timeout_s=cfg.timeout_s)
        router = await shared_router(cfg.rollstream_settings(), submitter_prefix=cfg.submitter_prefix)
        resubmits = 0
        while True:
            result = await router.run_job(job, timeout_s=cfg.wait_timeout_s or cfg.timeout_s + 300.0)
            if not result.infrastructure_failure or resubmits >= cfg.infrastructure_resubmits:
                break
            resubmits += 1
            log.warning("rollstream job %s failed by the service (%s); submitting it anew (%d of %d)",
                        result.job_id, result.error, resubmits, cfg.infrastructure_resubmits)
            job = job.model_copy(update={"job_id": new_id()})
        if result.ok and result.trajectory is not None:
            samples = segment_samples(result, response_length=self.response_length)
            if "session_id" in kwargs:  # verl v1: every segment is a row; verl shares the last one's advantage
                for sample in samples:
                    sample.extra_fields.update(rollstream_resubmits=resubmits, reward_extra_info={})
                return [self._output(sample) for sample in samples]
            if len(samples) > 1:
                log.warning("rollstream job %s made %d segments; verl's legacy trainer takes one sequence per "
                            "sample, so only the last is trained on (trainer.use_v1=True trains every one)",
                            result.job_id, len(samples))
            sample = samples[-1]
            sample.extra_fields["rollstream_untrained_segments"] = len(samples) - 1
        elif result.infrastructure_failure:
            raise RolloutFailed(
                f"rollstream job {result.job_id} (task {result.task}) failed by the service "
                f"{resubmits + 1} times{f' in {result.error_stage}' if result.error_stage else ''}: {result.error}. "
                "An infrastructure failure is never scored 0; see 'rollstream status' for dead workers, "
                "backends or sandboxes, or raise infrastructure_resubmits")
        elif result.task_failure:  # a broken environment: neither a sample nor worth running again
            raise RolloutFailed(
                f"rollstream job {result.job_id} (task {result.task}): its environment is broken"
                f"{f' (in {result.error_stage})' if result.error_stage else ''}: {result.error}. Mend the "
                "environment or leave it out of the dataset; a broken environment is never scored 0")
        else:
            sample = await self._on_failed(result, kwargs)
        sample.extra_fields["rollstream_resubmits"] = resubmits
        return self._output(sample)

    async def _on_failed(self, result: Result, row: dict[str, Any]) -> VerlSample:
        if self.loop_config.on_failure == "raise":
            raise RolloutFailed(
                f"rollstream job {result.job_id} (task {result.task}) {result.status}"
                f"{f' in {result.error_stage}' if result.error_stage else ''}: {result.error}. "
                "See 'rollstream status' / the dead-letter stream; set on_failure: zero_reward in the agent "
                "loop config to train on without it")
        log.warning("rollstream job %s %s (%s); returning a zero-reward sample", result.job_id, result.status,
                    result.error)
        if result.trajectory is not None and result.trajectory.prompt_ids:
            prompt_ids = result.trajectory.prompt_ids
        else:  # no trajectory: verl's own tokenization of the row's prompt stands in
            prompt_ids = await self.ct_build_initial_tokens(list(row.get("raw_prompt") or []))
        return failed_sample(result, prompt_ids)

    def _output(self, sample: VerlSample) -> AgentLoopOutput:
        # A prompt longer than rollout.prompt_length is cut the way verl's own loops cut it.
        prompt_ids = self._cap_text_prompt_length(sample.prompt_ids)
        return AgentLoopOutput(
            prompt_ids=prompt_ids, response_ids=sample.response_ids, response_mask=sample.response_mask,
            response_logprobs=sample.response_logprobs, reward_score=sample.reward_score,
            num_turns=sample.num_turns, metrics=AgentLoopMetrics(**sample.metrics),
            extra_fields=sample.extra_fields)
