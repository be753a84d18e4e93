"""Weight sync, the trainer's last act each step: save the policy as safetensors in a
versioned folder, tell every inference backend to load it, and report the new policy
version (the trainer then stores it in Redis, where run workers stamp it on trajectories).

Two strategies, one per kind of backend:
- `builtin`: rollstream's own server, `POST {url}/v1/load_weights {"path", "policy_version"}`.
- `vllm_reload`: an unmodified vLLM started with `VLLM_SERVER_DEV_MODE=1` on a folder that
  the trainer can write (shared disk). The trainer replaces that folder's *.safetensors
  (write beside, then rename: a reader never sees half a file), then calls vLLM's dev-mode
  `POST /collective_rpc {"method": "reload_weights"}`, which has every worker re-run its
  model loader on the same folder, and `POST /reset_prefix_cache` so no KV computed with the
  old weights is reused. With `sleep_first` the reload is wrapped in vLLM's sleep mode
  (`/sleep?level=2`, `/wake_up?tags=weights`, reload, `/wake_up?tags=kv_cache`), the path
  vLLM documents for freeing GPU memory between RL phases (needs `--enable-sleep-mode`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import httpx
from pydantic import BaseModel, Field

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A backend did not take the new weights."""


class WeightSyncBackend(Protocol):
    url: str

    async def load(self, client: httpx.AsyncClient, weights_dir: Path, policy_version: int) -> None:
        """Make the backend serve `weights_dir` from now on, reporting `policy_version`."""


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code >= 400:
        raise WeightSyncError(f"{what} answered {response.status_code}: {response.text[:500]}")


@dataclass
class BuiltinServerBackend:
    """rollstream's built-in server (`rollstream serve-model`)."""

    url: str

    async def load(self, client: httpx.AsyncClient, weights_dir: Path, policy_version: int) -> None:
        response = await client.post(
            f"{self.url.rstrip('/')}/v1/load_weights",
            json={"path": str(weights_dir), "policy_version": policy_version},
        )
        _check(response, f"{self.url}/v1/load_weights")
        served = response.json().get("policy_version")
        if served != policy_version:
            raise WeightSyncError(f"{self.url} reports policy version {served} after loading {policy_version}")


@dataclass
class VllmReloadBackend:
    """An unmodified vLLM (dev mode) serving `served_model_dir`; see the module docstring."""

    url: str
    served_model_dir: Path
    sleep_first: bool = False

    async def load(self, client: httpx.AsyncClient, weights_dir: Path, policy_version: int) -> None:
        await asyncio.to_thread(replace_safetensors, weights_dir, Path(self.served_model_dir))
        base = self.url.rstrip("/")
        if self.sleep_first:
            _check(await client.post(f"{base}/sleep", params={"level": 2}), f"{base}/sleep")
            _check(await client.post(f"{base}/wake_up", params={"tags": "weights"}), f"{base}/wake_up?tags=weights")
        response = await client.post(f"{base}/collective_rpc", json={"method": "reload_weights"})
        if response.status_code == 404:
            raise WeightSyncError(
                f"{base}/collective_rpc not found: start vLLM with VLLM_SERVER_DEV_MODE=1 so that "
                "its dev endpoints (collective_rpc, reset_prefix_cache, sleep) are served"
            )
        _check(response, f"{base}/collective_rpc reload_weights")
        if self.sleep_first:
            _check(await client.post(f"{base}/wake_up", params={"tags": "kv_cache"}), f"{base}/wake_up?tags=kv_cache")
        _check(await client.post(f"{base}/reset_prefix_cache"), f"{base}/reset_prefix_cache")


def replace_safetensors(source_dir: Path, target_dir: Path) -> None:
    """Put source_dir's *.safetensors (+ index) into target_dir, each file atomically."""
    target_dir.mkdir(parents=True, exist_ok=True)
    new = {p.name for p in source_dir.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json"))}
    if not new:
        raise WeightSyncError(f"{source_dir} holds no *.safetensors; was the model saved with safe_serialization?")
    for name in sorted(new):
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=target_dir)
        os.close(fd)
        shutil.copyfile(source_dir / name, tmp)
        os.replace(tmp, target_dir / name)
    for stale in target_dir.glob("*.safetensors"):
        if stale.name not in new:
            stale.unlink()  # a shard layout that changed would otherwise load twice


class BackendSpec(BaseModel):
    """One inference server the trainer publishes to (a [[trainer.backends]] TOML table)."""

    type: Literal["builtin", "vllm_reload"] = "builtin"
    url: str
    served_model_dir: str | None = Field(None, description="vllm_reload: the folder vLLM was started on")
    sleep_first: bool = Field(False, description="vllm_reload: wrap the reload in sleep/wake_up")

    def build(self) -> WeightSyncBackend:
        if self.type == "builtin":
            return BuiltinServerBackend(self.url)
        if not self.served_model_dir:
            raise ValueError(f"backend {self.url}: type 'vllm_reload' needs served_model_dir (the folder vLLM serves)")
        return VllmReloadBackend(self.url, Path(self.served_model_dir), self.sleep_first)


@dataclass
class SyncReport:
    policy_version: int
    weights_dir: Path
    save_s: float
    load_s: float

    @property
    def total_s(self) -> float:
        return self.save_s + self.load_s


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a sibling temp folder to fill; on success it replaces ``final`` in one rename,
    so a reader (a backend, a resuming trainer) never sees a half-written folder."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def save_weights(model, tokenizer, out_dir: Path) -> Path:
    """save_pretrained (safetensors) into out_dir atomically."""
    with atomic_folder(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out_dir)


class WeightPublisher:
    """Saves versioned weights under `root` and makes every backend load them."""

    def __init__(
        self,
        root: Path | str,
        backends: list[WeightSyncBackend],
        keep_versions: int = 2,
        timeout_s: float = 300.0,
    ) -> None:
        self.root = Path(root)
        self.backends = backends
        self.keep_versions = max(keep_versions, 1)
        self.timeout_s = timeout_s

    def version_dir(self, policy_version: int) -> Path:
        return self.root / f"policy-v{policy_version:06d}"

    async def publish(self, model, tokenizer, policy_version: int) -> SyncReport:
        started = time.monotonic()
        weights_dir = await asyncio.to_thread(save_weights, model, tokenizer, self.version_dir(policy_version))
        saved = time.monotonic()
        async with httpx.AsyncClient(timeout=self.timeout_s) as client:
            outcomes = await asyncio.gather(
                *(b.load(client, weights_dir, policy_version) for b in self.backends), return_exceptions=True
            )
        failed = [(b.url, o) for b, o in zip(self.backends, outcomes) if isinstance(o, BaseException)]
        if failed:
            details = "; ".join(f"{url}: {err!r}" for url, err in failed)
            raise WeightSyncError(
                f"{len(failed)} of {len(self.backends)} backends did not load policy v{policy_version} "
                f"from {weights_dir}: {details}. A backend that keeps the old weights produces stale "
                "trajectories; fix or deregister it ('rollstream backends remove URL')"
            )
        loaded = time.monotonic()
        self._prune(policy_version)
        log.info("published policy v%d to %d backends", policy_version, len(self.backends))
        return SyncReport(policy_version, weights_dir, save_s=saved - started, load_s=loaded - saved)

    def _prune(self, current: int) -> None:
        for old in sorted(self.root.glob("policy-v*")):
            try:
                version = int(old.name.removeprefix("policy-v"))
            except ValueError:
                continue
            if version <= current - self.keep_versions:
                shutil.rmtree(old, ignore_errors=True)
