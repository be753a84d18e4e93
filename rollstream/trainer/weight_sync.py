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
import contextlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
import weakref
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
from pydantic import BaseModel, Field

from rollstream.llm.weights_transfer import (
    SHM_ROOT,
    MappedWriter,
    Placement,
    Transfer,
    choose_transfer,
    export_cuda_ipc,
    placement,
    write_safetensors,
)

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
        await self._load(client, {"path": str(weights_dir), "policy_version": policy_version}, policy_version)

    async def load_cuda_ipc(self, client: httpx.AsyncClient, handles: dict[str, Any], policy_version: int) -> None:
        """Make the server copy the trainer's GPU tensors through their CUDA IPC handles."""
        await self._load(client, {"cuda_ipc": handles, "policy_version": policy_version}, policy_version)

    async def placement(self, client: httpx.AsyncClient) -> Placement | None:
        """Where the server runs (host, /dev/shm, GPU); None from a server too old to say."""
        response = await client.get(f"{self.url.rstrip('/')}/v1/weights_placement")
        if response.status_code == 404:
            return None
        _check(response, f"{self.url}/v1/weights_placement")
        return Placement(**response.json())

    async def _load(self, client: httpx.AsyncClient, body: dict[str, Any], policy_version: int) -> None:
        response = await client.post(f"{self.url.rstrip('/')}/v1/load_weights", json=body)
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
                woke = await client.post(f"{base}/wake_up", params={"tags": "kv_cache"})
                _check(woke, f"{base}/wake_up?tags=kv_cache")
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
    weights_dir: Path | None  # None where the weights went by CUDA IPC
    save_s: float
    load_s: float
    # backend URL -> the policy version it serves after this sync
    served: dict[str, int] = field(default_factory=dict)
    transfer: str = "disk"

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


def save_weights(model, tokenizer, out_dir: Path, *, weights_only: bool = False, reuse: Path | None = None,
                 writer: MappedWriter | None = None) -> Path:
    """The model's weights (model.safetensors, in the model's own dtype) and config into out_dir,
    atomically; a folder from_pretrained, the built-in server and vLLM all read. `weights_only`
    (a transient shared-memory folder) leaves out config and tokenizer; `reuse` is an older
    model.safetensors whose pages the new one takes over (write_safetensors)."""
    with atomic_folder(out_dir) as tmp:
        if writer is not None:
            writer.write(_tensors_to_save(model), tmp / "model.safetensors", reuse=reuse)
        else:
            write_safetensors(_tensors_to_save(model), tmp / "model.safetensors", reuse=reuse)
        if not weights_only:
            model.config.save_pretrained(tmp)
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
    return Path(out_dir)


SHM_PREFIX = "rollstream-weights-"


def remove_stale_shm_folders(shm_root: Path = SHM_ROOT) -> list[Path]:
    """Delete the shared-memory weight folders of publishers whose process is gone (a trainer
    that was killed cannot clean up; its weights would hold RAM until reboot)."""
    removed = []
    for folder in Path(shm_root).glob(f"{SHM_PREFIX}*"):
        try:
            pid = int(folder.name.removeprefix(SHM_PREFIX).split("-")[0])
            if folder.stat().st_uid != os.getuid():
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        except (ValueError, OSError):
            continue
    return removed


class WeightPublisher:
    """Saves versioned weights and makes every backend load them. How the weights travel is
    `transfer` (see rollstream/llm/weights_transfer.py): `disk` writes `root`/policy-vNNNNNN
    (kept, `keep_versions` of them), `shm` the same file in a tmpfs folder of this process
    under /dev/shm (only the newest kept, its pages reused by the next sync, removed at exit),
    `cuda_ipc` sends the GPU tensors' IPC handles; `auto` asks each built-in server where it
    runs and picks per sync. With `redis`, each sync notes in the backends' balancer records
    which version each one serves (`policy_version`, or `policy_sync_error` when it kept the old
    one): `rollstream backends list` and `GET /v1/backends` show them."""

    def __init__(
        self,
        root: Path | str,
        backends: list[WeightSyncBackend],
        keep_versions: int = 2,
        timeout_s: float = 300.0,
        redis: Any = None,
        namespace: str = "rs",
        pause_generation: bool = True,
        transfer: Transfer = "auto",
        shm_root: Path | str = SHM_ROOT,
    ) -> None:
        self.root = Path(root)
        self.pause_generation = pause_generation
        self.backends = backends
        self.keep_versions = max(keep_versions, 1)
        self.timeout_s = timeout_s
        self.redis = redis
        self.namespace = namespace
        self.served: dict[str, int] = {}
        self.transfer = transfer
        self.shm_root = Path(shm_root)
        self._shm_dir: Path | None = None
        self._ipc_failed: str | None = None  # why CUDA IPC failed once; auto then stages through memory
        self._tls: Any = None
        self._writer = MappedWriter()  # keeps the shared-memory file mapped between syncs

    def version_dir(self, policy_version: int, root: Path | None = None) -> Path:
        return (root or self.root) / f"policy-v{policy_version:06d}"

    async def choose(self, client: httpx.AsyncClient, model) -> str:
        """The transfer of the next sync (choose_transfer on every server's placement)."""
        device = next(model.parameters()).device
        if self.transfer != "auto":
            if self.transfer == "cuda_ipc" and device.type != "cuda":
                raise WeightSyncError(f"transfer 'cuda_ipc' needs the model on a GPU; it is on {device}")
            return self.transfer
        servers = list(await asyncio.gather(*(self._placement_of(b, client) for b in self.backends)))
        chosen = choose_transfer("auto", placement(device), servers)
        if chosen == "cuda_ipc" and self._ipc_failed:
            chosen = choose_transfer("auto", placement("cpu"), servers)
        if chosen == "shm" and not self._shm_has_room(model):
            log.warning("%s has no room for the weights: syncing through %s instead", self.shm_root, self.root)
            chosen = "disk"
        return chosen

    @staticmethod
    async def _placement_of(backend: WeightSyncBackend, client: httpx.AsyncClient) -> Placement | None:
        ask = getattr(backend, "placement", None)
        if ask is None:
            return None  # not a built-in server: assumed elsewhere
        try:
            return await ask(client)
        except (httpx.HTTPError, WeightSyncError, TypeError) as exc:
            log.info("%s did not say where it runs (%s): assumed on another host", backend.url, exc)
            return None

    def _shm_has_room(self, model) -> bool:
        needed = sum(p.numel() * p.element_size() for p in model.parameters())
        reusable = self._previous_shm_file()
        if reusable is not None:
            needed -= reusable.stat().st_size
        stats = os.statvfs(self.shm_root)
        return stats.f_bavail * stats.f_frsize > needed + (64 << 20)

    def _previous_shm_file(self) -> Path | None:
        if self._shm_dir is None:
            return None
        files = sorted(self._shm_dir.glob("policy-v*/model.safetensors"))
        return files[-1] if files else None

    def _shm_folder(self) -> Path:
        if self._shm_dir is None:
            remove_stale_shm_folders(self.shm_root)
            self._shm_dir = Path(tempfile.mkdtemp(prefix=f"{SHM_PREFIX}{os.getpid()}-", dir=self.shm_root))
            weakref.finalize(self, shutil.rmtree, self._shm_dir, True)  # at exit too
        return self._shm_dir

    def close(self) -> None:
        """Free the shared-memory copy (also done at exit)."""
        self._writer.close()
        if self._shm_dir is not None:
            shutil.rmtree(self._shm_dir, ignore_errors=True)
            self._shm_dir = None

    async def _save(self, model, tokenizer, policy_version: int, transfer: str) -> Path:
        if transfer == "disk":
            return await asyncio.to_thread(save_weights, model, tokenizer, self.version_dir(policy_version))
        folder = self._shm_folder()
        previous = self._previous_shm_file()
        reuse = None
        if previous is not None:  # out of sight whole (no version folder without its file), pages kept
            recycled = folder / f".recycled-{previous.parent.name}"
            os.rename(previous.parent, recycled)
            reuse = recycled / previous.name
        try:
            return await asyncio.to_thread(save_weights, model, None, self.version_dir(policy_version, folder),
                                           weights_only=True, reuse=reuse, writer=self._writer)
        finally:
            for old in [*folder.glob(".recycled-*"), *folder.glob("policy-v*")]:
                if old.name != f"policy-v{policy_version:06d}":
                    shutil.rmtree(old, ignore_errors=True)

    async def _load_all(self, client: httpx.AsyncClient, model, weights_dir: Path | None, policy_version: int,
                        handles: dict[str, Any] | None) -> list[BaseException | None]:
        if handles is not None:
            calls = [b.load_cuda_ipc(client, handles, policy_version) for b in self.backends]  # type: ignore[attr-defined]
        else:
            assert weights_dir is not None
            calls = [b.load(client, weights_dir, policy_version) for b in self.backends]
        return list(await asyncio.gather(*calls, return_exceptions=True))

    async def publish(self, model, tokenizer, policy_version: int) -> SyncReport:
        started = time.monotonic()
        if self._tls is None:  # made once: loading the CA bundle cost 35-60 ms a sync here
            self._tls = httpx.create_ssl_context()
        async with httpx.AsyncClient(timeout=self.timeout_s, verify=self._tls) as client:
            transfer = await self.choose(client, model)
            weights_dir: Path | None = None
            handles: dict[str, Any] | None = None
            shared: dict[str, Any] | None = None
            if transfer == "cuda_ipc":
                # the model's own tensors, nothing saved; held here (a renamed one may be a new
                # tensor) until every server has copied them
                shared = _tensors_to_save(model)
                try:
                    handles = export_cuda_ipc(shared)
                except (RuntimeError, ValueError) as exc:  # memory that cannot be shared (allocator, offload)
                    if self.transfer != "auto":
                        raise WeightSyncError(f"cannot share the model's GPU memory by CUDA IPC: {exc}; "
                                              "set the transfer to 'shm' (or 'auto')") from exc
                    self._ipc_failed = repr(exc)
                    log.warning("cannot export CUDA IPC handles (%s); staging through shared memory or disk", exc)
                    shared = None
                    transfer = await self.choose(client, model)
            if handles is None:
                weights_dir = await self._save(model, tokenizer, policy_version, transfer)
            saved = time.monotonic()
            async with self._generation_paused(policy_version):
                outcomes = await self._load_all(client, model, weights_dir, policy_version, handles)
                ipc_failed = any(isinstance(o, BaseException) for o in outcomes)
                if handles is not None and self.transfer == "auto" and ipc_failed:
                    # Most likely a server that cannot open another process's GPU memory (a
                    # container without IPC, another driver): stage through memory from now on.
                    self._ipc_failed = "; ".join(repr(o) for o in outcomes if isinstance(o, BaseException))
                    log.warning("CUDA IPC weight sync failed (%s); staging through shared memory or disk instead",
                                self._ipc_failed)
                    transfer = await self.choose(client, model)
                    weights_dir = await self._save(model, tokenizer, policy_version, transfer)
                    saved = time.monotonic()
                    outcomes = await self._load_all(client, model, weights_dir, policy_version, None)
                shared = None  # every server has copied (or failed to): the trainer may change its tensors
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
                f"by {transfer} ({weights_dir or 'CUDA IPC handles'}): {details}. A backend that keeps the old "
                "weights produces stale trajectories; fix or deregister it ('rollstream backends remove URL')"
                + (". A server on another host cannot read this machine's /dev/shm: set the transfer to 'disk' "
                   "on storage both see" if transfer == "shm" else "")
            )
        loaded = time.monotonic()
        if transfer == "disk":
            self._prune(policy_version)
        log.info("published policy v%d to %d backends by %s", policy_version, len(self.backends), transfer)
        return SyncReport(policy_version, weights_dir, save_s=saved - started, load_s=loaded - saved,
                          served={b.url: policy_version for b in self.backends}, transfer=transfer)

    def _generation_paused(self, policy_version: int) -> AbstractAsyncContextManager:
        """With Redis, generation is paused on every backend while they load (turns in flight
        finish first, none starts until all have loaded), so no turn mixes two policies and
        every backend serves the new one from the same moment; saving happens before."""
        if self.redis is None or not self.pause_generation:
            return contextlib.nullcontext()
        from rollstream.llm.balancer import generation_paused

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
    from rollstream.llm.balancer import Balancer, normalize_url

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
