"""Keeps rollstream's inference backends on TRL's current policy: a ``TrainerCallback``
that, after each optimizer step, publishes the model through the trainer's own weight path
(``rollstream.trainer.weight_sync.WeightPublisher``) and bumps the policy version in Redis,
so the next rollouts run on the new weights and carry the new version."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from rollstream.config import Settings
from rollstream.integrations.trl_bridge import RollstreamConnection
from rollstream.llm.balancer import list_backends
from rollstream.trainer.weight_sync import BuiltinServerBackend, SyncReport, WeightPublisher, WeightSyncBackend

log = logging.getLogger(__name__)


class WeightSyncCallback(TrainerCallback):
    """Publish TRL's policy to every backend as version ``state.global_step``.

    ``backends`` defaults to the built-in servers registered with the balancer, read at
    each publish (so servers added mid-run are included); pass ``BackendSpec(...).build()``
    objects for vLLM. Share the rollout function's connection with ``rollout_func=``, or
    give ``redis_url``/``settings``. Only the main process publishes."""

    def __init__(
        self,
        weights_dir: Path | str,
        *,
        rollout_func: Any = None,
        redis_url: str | None = None,
        settings: Settings | None = None,
        backends: list[WeightSyncBackend] | None = None,
        sync_every_steps: int = 1,
        publish_on_train_begin: bool = True,
        keep_versions: int = 2,
        timeout_s: float = 300.0,
    ) -> None:
        if sync_every_steps < 1:
            raise ValueError("sync_every_steps must be ≥ 1")
        shared = getattr(rollout_func, "connection", None)
        self._owns_connection = shared is None
        self.connection: RollstreamConnection = shared or RollstreamConnection(redis_url, settings=settings)
        self.fixed_backends = backends
        self.publisher = WeightPublisher(weights_dir, backends or [], keep_versions=keep_versions,
                                         timeout_s=timeout_s)
        self.sync_every_steps = sync_every_steps
        self.publish_on_train_begin = publish_on_train_begin
        self.reports: list[SyncReport] = []
        self.published_version: int | None = None

    async def _publish(self, model: Any, tokenizer: Any, version: int) -> SyncReport:
        client = self.connection.client
        # the balancer records which version each backend serves (`rollstream backends list`)
        self.publisher.redis, self.publisher.namespace = client.r, self.connection.namespace
        if self.fixed_backends is None:
            registered = await list_backends(client.r, self.connection.namespace)
            self.publisher.backends = [BuiltinServerBackend(b.url) for b in registered]
            if not registered:
                log.warning("no inference backend registered in namespace '%s': rollouts stay on the old "
                            "policy; register them ('rollstream backends add URL')", self.connection.namespace)
        report = await self.publisher.publish(model, tokenizer, version)
        # after the backends load it: a run worker never stamps a version its backend lacks
        await client.set_policy_version(version)
        return report

    def publish(self, model: Any, tokenizer: Any, version: int) -> SyncReport:
        """Save ``model`` (and ``tokenizer``), make every backend load it, set the version."""
        report = self.connection.run(self._publish(_unwrap(model), tokenizer, version))
        self.reports.append(report)
        self.published_version = version
        log.info("policy v%d published in %.2fs (save %.2fs, load %.2fs)", version, report.total_s,
                 report.save_s, report.load_s)
        return report

    # -- TrainerCallback hooks ---------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        # backends may serve anything (the base model, another run): make them serve ours
        if self.publish_on_train_begin and state.is_world_process_zero and model is not None:
            self.publish(model, processing_class, state.global_step)

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step % self.sync_every_steps or not state.is_world_process_zero or model is None:
            return
        self.publish(model, processing_class, state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        if self._owns_connection:
            self.connection.close()


def _unwrap(model: Any) -> Any:
    """The plain model under DDP-style wrappers (``save_pretrained`` lives there)."""
    while not hasattr(model, "save_pretrained") and hasattr(model, "module"):
        model = model.module
    return model
