"""Weight sync, the trainer's last act each step: save the policy as safetensors in a
versioned folder, tell every inference backend to load it, and report the new policy
version (the trainer then stores it in Redis, where run workers stamp it on trajectories).

Two strategies, one per kind of backend:
- `builtin`: rollstream's own server, `POST {url}/v1/load_weights {"path", "policy_version"}`.
- `vllm_reload`: an unmodified vLLM started with `VLLM_SERVER_DEV_MODE=1` on a folder that
  the trainer can write (shared disk). The trainer replaces that folder's *.safetensors
  (write beside, then rename: a reader never sees half a file; each file keeps its mode, so
  a vLLM running as another user can still read it), then calls vLLM's dev-mode
  `POST /collective_rpc {"method": "reload_weights"}`, which has every worker re-run its
  model loader on the same folder, and `POST /reset_prefix_cache` so no KV computed with the
  old weights is reused. With `sleep_first` the reload is wrapped in vLLM's sleep mode
  (`/sleep?level=2`, `/wake_up?tags=weights`, reload, `/wake_up?tags=kv_cache`), the path
  vLLM documents for freeing GPU memory between RL phases (needs `--enable-sleep-mode`).
  Atomic from the server's view: the files replaced are kept (hard links) until vLLM has
  reloaded; if any call fails they are put back (and vLLM reloaded on them), so a folder never
  holds weights vLLM is not serving. `rollstream-policy.json` in the folder names the version
  it holds, and every sync records each backend's version in its balancer record.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator
import contextlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncContextManager, Literal, Protocol

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
        served = Path(self.served_model_dir)
        base = self.url.rstrip("/")
        swap = await asyncio.to_thread(stage_safetensors, weights_dir, served)
        reload_sent = False
        try:
            if self.sleep_first:
                _check(await client.post(f"{base}/sleep", params={"level": 2}), f"{base}/sleep")
                _check(await client.post(f"{base}/wake_up", params={"tags": "weights"}), f"{base}/wake_up?tags=weights")
            reload_sent = True
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
        except BaseException:
            # Put back the weights vLLM serves, so that a restart serves what the trainer
            # believes it serves; vLLM may have read the new files already: it reads the old again.
            await asyncio.to_thread(swap.rollback)
            if reload_sent:
                try:
                    await client.post(f"{base}/collective_rpc", json={"method": "reload_weights"})
                    await client.post(f"{base}/reset_prefix_cache")
                except httpx.HTTPError as exc:
                    log.warning("%s: could not reload the restored weights in %s: %s", base, served, exc)
            raise
        await asyncio.to_thread(swap.commit, policy_version, Path(weights_dir))


# The served folder's previous weight files while a sync is in progress (vLLM globs only the
# folder's top level, so it never loads these), and the record of the version it holds.
PREVIOUS_WEIGHTS_DIR = ".rollstream-previous"
SERVED_VERSION_FILE = "rollstream-policy.json"


def _weight_files(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
            and p.name.endswith((".safetensors", ".safetensors.index.json"))}


@dataclass
class StagedWeights:
    """New weights written into a served folder, the replaced ones kept aside until the
    server has loaded the new ones (commit) or failed to (rollback)."""

    target_dir: Path

    def commit(self, policy_version: int, source_dir: Path) -> None:
        record = {"policy_version": policy_version, "source": str(source_dir), "loaded_at": time.time()}
        fd, tmp = tempfile.mkstemp(prefix=f".{SERVED_VERSION_FILE}.", dir=self.target_dir)
        with os.fdopen(fd, "w") as out:
            json.dump(record, out)
        os.chmod(tmp, 0o644)
        os.replace(tmp, self.target_dir / SERVED_VERSION_FILE)
        shutil.rmtree(self.target_dir / PREVIOUS_WEIGHTS_DIR, ignore_errors=True)

    def rollback(self) -> None:
        restore_previous_weights(self.target_dir)


def restore_previous_weights(target_dir: Path) -> bool:
    """Undo a sync that did not finish (its previous files are still set aside); True if it did."""
    backup = Path(target_dir) / PREVIOUS_WEIGHTS_DIR
    if not backup.is_dir():
        return False
    kept = _weight_files(backup)
    for name in kept:
        os.replace(backup / name, target_dir / name)
    for extra in _weight_files(target_dir) - kept:
        (target_dir / extra).unlink()
    shutil.rmtree(backup)
    log.warning("restored the previous weights in %s (a sync did not complete)", target_dir)
    return True


def stage_safetensors(source_dir: Path, target_dir: Path) -> StagedWeights:
    """Put source_dir's *.safetensors (+ index) into target_dir, each file atomically and with
    the mode of the file it replaces; the replaced files are kept until commit or rollback."""
    source_dir, target_dir = Path(source_dir), Path(target_dir)
    target_dir.mkdir(parents=True, exist_ok=True)
    new = _weight_files(source_dir) if source_dir.is_dir() else set()
    if not new:
        raise WeightSyncError(f"{source_dir} holds no *.safetensors; was the model saved with safe_serialization?")
    restore_previous_weights(target_dir)  # a sync that died half-way: start from what is served
    aside = Path(tempfile.mkdtemp(prefix=f"{PREVIOUS_WEIGHTS_DIR}.", dir=target_dir))
    old = _weight_files(target_dir)
    for name in old:
        try:
            os.link(target_dir / name, aside / name)
        except OSError:  # a filesystem without hard links
            shutil.copy2(target_dir / name, aside / name)
    os.rename(aside, target_dir / PREVIOUS_WEIGHTS_DIR)  # the backup appears complete or not at all
    for name in sorted(new):
        mode_of = target_dir / name if name in old else source_dir / name
        mode = stat.S_IMODE(os.stat(mode_of).st_mode)
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=target_dir)
        os.close(fd)
        shutil.copyfile(source_dir / name, tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, target_dir / name)
    for stale in old - new:
        (target_dir / stale).unlink()  # a shard layout that changed would otherwise load twice
    return StagedWeights(target_dir)


def served_version(served_model_dir: Path | str) -> int | None:
    """The policy version a vllm_reload folder holds (None before the first sync)."""
    try:
        return int(json.loads((Path(served_model_dir) / SERVED_VERSION_FILE).read_text())["policy_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
    # backend URL -> the policy version it serves after this sync
    served: dict[str, int] = field(default_factory=dict)

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


_SAFETENSORS_DTYPES = {  # torch dtype name -> safetensors dtype (torch is imported only when saving)
    "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


def _tensors_to_save(model) -> dict[str, Any]:
    """The model's tensors under the names save_pretrained would write: tied aliases dropped,
    transformers' load-time renamings reverted (transformers 5); no tensor copied."""
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4: no renaming on load; drop aliases by storage
        seen: set[tuple[int, int]] = set()
        kept = {}
        for name, tensor in state.items():
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
            if key not in seen:
                seen.add(key)
                kept[name] = tensor
        return kept
    return revert_weight_conversion(model, remove_tied_weights_from_state_dict(state, model))


def write_safetensors(tensors: dict[str, Any], path: Path, metadata: dict[str, str] | None = None) -> None:
    """A .safetensors file written tensor by tensor straight from each tensor's memory (one
    device-to-host copy for a GPU tensor, none for a contiguous CPU one) - safetensors' own
    save_file first turns every tensor into a bytes object, a second copy of the model."""
    import torch

    header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _SAFETENSORS_DTYPES:
            raise WeightSyncError(f"tensor {name} has dtype {dtype}, which safetensors cannot store")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as out:
        out.write(len(encoded).to_bytes(8, "little"))
        out.write(encoded)
        for tensor in tensors.values():
            host = tensor.detach().to("cpu").contiguous()
            if host.numel():
                out.write(memoryview(host.view(-1).view(torch.uint8).numpy()))


def save_weights(model, tokenizer, out_dir: Path) -> Path:
    """The model's weights (model.safetensors, in the model's own dtype) and config into out_dir,
    atomically; a folder from_pretrained, the built-in server and vLLM all read."""
    with atomic_folder(out_dir) as tmp:
        write_safetensors(_tensors_to_save(model), tmp / "model.safetensors")
        model.config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
    return Path(out_dir)


class WeightPublisher:
    """Saves versioned weights under `root` and makes every backend load them. With `redis`,
    each sync notes in the backends' balancer records which version each one serves
    (`policy_version`, or `policy_sync_error` when it kept the old one): `rollstream backends
    list` and `GET /v1/backends` show them."""

    def __init__(
        self,
        root: Path | str,
        backends: list[WeightSyncBackend],
        keep_versions: int = 2,
        timeout_s: float = 300.0,
        redis: Any = None,
        namespace: str = "rs",
        pause_generation: bool = True,
    ) -> None:
        self.root = Path(root)
        self.pause_generation = pause_generation
        self.backends = backends
        self.keep_versions = max(keep_versions, 1)
        self.timeout_s = timeout_s
        self.redis = redis
        self.namespace = namespace
        self.served: dict[str, int] = {}

    def version_dir(self, policy_version: int) -> Path:
        return self.root / f"policy-v{policy_version:06d}"

    async def publish(self, model, tokenizer, policy_version: int) -> SyncReport:
        started = time.monotonic()
        weights_dir = await asyncio.to_thread(save_weights, model, tokenizer, self.version_dir(policy_version))
        saved = time.monotonic()
        async with self._generation_paused(policy_version), httpx.AsyncClient(timeout=self.timeout_s) as client:
            outcomes = await asyncio.gather(
                *(b.load(client, weights_dir, policy_version) for b in self.backends), return_exceptions=True
            )
        for backend, outcome in zip(self.backends, outcomes):
            if not isinstance(outcome, BaseException):
                self.served[backend.url] = policy_version
        if self.redis is not None:
            await record_served_versions(self.redis, self.namespace, policy_version,
                                         {b.url: o for b, o in zip(self.backends, outcomes)})
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
        return SyncReport(policy_version, weights_dir, save_s=saved - started, load_s=loaded - saved,
                          served={b.url: policy_version for b in self.backends})

    def _generation_paused(self, policy_version: int) -> AsyncContextManager:
        """With Redis, generation is paused on every backend while they load (turns in flight
        finish first, none starts until all have loaded), so no turn mixes two policies and
        every backend serves the new one from the same moment; saving happens before."""
        if self.redis is None or not self.pause_generation:
            return contextlib.nullcontext()
        from rollstream.pipeline.balancer import generation_paused

        return generation_paused(self.redis, self.namespace, f"weight sync to policy v{policy_version}",
                                 drain_timeout_s=self.timeout_s)

    def _prune(self, current: int) -> None:
        for old in sorted(self.root.glob("policy-v*")):
            try:
                version = int(old.name.removeprefix("policy-v"))
            except ValueError:
                continue
            if version <= current - self.keep_versions:
                shutil.rmtree(old, ignore_errors=True)


async def record_served_versions(redis: Any, namespace: str, policy_version: int,
                                 outcomes: dict[str, BaseException | None]) -> None:
    """Note in each registered backend's balancer record the policy version it serves after a
    sync to `policy_version` (a backend that failed keeps its old one, with the error)."""
    from rollstream.pipeline.balancer import Balancer, normalize_url

    balancer = Balancer(redis, namespace=namespace)
    known = {row.url: row.info for row in await balancer.backends()}
    for url, outcome in outcomes.items():
        url = normalize_url(url)
        if url not in known:
            continue  # not in the balancer (a fixed list in the config): nothing to annotate
        info = dict(known[url])
        if isinstance(outcome, BaseException):
            info["policy_sync_error"] = f"did not load v{policy_version}: {outcome}"[:500]
        else:
            info.pop("policy_sync_error", None)
            info.update(policy_version=policy_version, policy_synced_at=time.time())
        await balancer.register(url, info)
