"""Image work queued through Redis: typed requests on one stream, run by `rollstream images worker`.

A node prepares images (images.py, env_images.py) when asked through Redis. Whoever can write
to Redis may ask, so a request is data, never code: JSON validated into one of the request
models below, dispatched by its `kind` to rollstream's own function. No function name, no
pickle, no callback travels in a request, and the places a request touches on the host (the
images folder, the repository mirror, the folders local tarballs may come from) are the
worker's own settings, not the request's. (This replaced rq, whose worker imports whatever
function a job names and unpickles its arguments.)
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from rollstream.sandboxes.env_images import IMAGE_REFERENCE

log = logging.getLogger(__name__)

STREAM = "rollstream:images:requests"
GROUP = "image-workers"
RESULT_PREFIX = "rollstream:images:result:"
RESULT_TTL_S = 7 * 86400
MAX_REQUEST_BYTES = 8 << 20
MAX_DELIVERIES = 3  # a request that killed its worker this often is answered as failed
URI_SCHEMES = ("docker", "docker-daemon", "oras", "library", "shub")

_Text = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00-\x1f]+$")]


class PullRequest(BaseModel):
    """`pull_image` of a registry URI, or of a local tarball/SIF below the worker's source folders."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["pull"] = "pull"
    source: _Text
    backend: Literal["bwrap", "singularity"] = "singularity"


class SifBuildRequest(BaseModel):
    """`build_image` of a definition file below the worker's source folders."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["sif"] = "sif"
    definition: _Text
    name: _Text


EnvironmentBackend = Literal["docker", "bwrap", "singularity"]


def _docker_only() -> list[EnvironmentBackend]:
    return ["docker"]


PresetName = Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,63}$")]


class EnvironmentsRequest(BaseModel):
    """Environment images of SWE records (tasks/swe_env.py), from the worker's own mirror; with
    ``harnesses``, each preset's layer on each image after it (agent/harness_images.py: the tag
    the --now path builds), its rootfs/SIF where ``backends`` ask. Presets are looked up in the
    worker's own preset folders, never taken from the request."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["environments"] = "environments"
    instances: list[dict[str, Any]] = Field(min_length=1, max_length=1000)
    backends: list[EnvironmentBackend] = Field(default_factory=_docker_only)
    force: bool = False
    harnesses: list[PresetName] = Field(default_factory=list, max_length=16)


ImageRequest = Annotated[PullRequest | SifBuildRequest | EnvironmentsRequest, Field(discriminator="kind")]
_REQUEST = TypeAdapter(ImageRequest)


class RefusedRequest(ValueError):
    """A request the worker will not run; the result says why."""


def _redis(redis_url: str):
    from redis import Redis

    return Redis.from_url(redis_url)


def enqueue(redis_url: str, request: PullRequest | SifBuildRequest | EnvironmentsRequest) -> str:
    """Queue `request`; returns its id (the stream entry's), under which `result` finds the outcome."""
    entry = _redis(redis_url).xadd(STREAM, {"request": request.model_dump_json()})
    return entry.decode() if isinstance(entry, bytes) else str(entry)


def result(redis_url: str, request_id: str) -> dict | None:
    """The outcome of a request: {"status": "finished"|"failed"|"refused", "result"|"error": ...}, or None yet."""
    raw = _redis(redis_url).get(RESULT_PREFIX + request_id)
    return None if raw is None else json.loads(raw)


def _below(path: str, folders: list[str]) -> str | None:
    """`path` resolved, when it is a regular file inside one of `folders`; else None."""
    real = os.path.realpath(path)
    for folder in folders:
        root = os.path.realpath(folder)
        if os.path.commonpath([real, root]) == root:
            try:
                if stat.S_ISREG(os.stat(real).st_mode):
                    return real
            except OSError:
                return None
    return None


@dataclass
class ImageWorker:
    """Runs queued image requests with this node's own folders.

    images_dir: where images go (None: image_cache's default); mirror: the SWE repository
    mirror (None: swe_repos' default); source_dirs: the only folders a queued pull's tarball
    or a SIF definition may come from (none by default: registry URIs only)."""

    redis_url: str
    images_dir: str | None = None
    mirror: str | None = None
    source_dirs: list[str] = field(default_factory=list)
    consumer: str = field(default_factory=socket.gethostname)
    preset_dirs: list[str] = field(default_factory=list)  # the operator's harness presets (harness_preset_dirs)

    def work(self, burst: bool = False, block_ms: int = 5000) -> int:
        """Serve requests; with `burst`, until the stream has none left. Returns how many were answered."""
        redis = _redis(self.redis_url)
        try:
            redis.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except Exception as error:  # redis.ResponseError; only BUSYGROUP (it exists) is expected
            if "BUSYGROUP" not in str(error):
                raise
        answered = 0
        while True:
            # This consumer's own unanswered requests first: what it held when it last died.
            entries = redis.xreadgroup(GROUP, self.consumer, {STREAM: "0"}, count=1)
            if not entries or not entries[0][1]:
                entries = redis.xreadgroup(GROUP, self.consumer, {STREAM: ">"}, count=1,
                                           block=None if burst else block_ms)
            if not entries or not entries[0][1]:
                if burst:
                    return answered
                continue
            entry_id, fields = entries[0][1][0]
            request_id = entry_id.decode()
            outcome = self._answer(redis, request_id, fields)
            redis.set(RESULT_PREFIX + request_id, json.dumps(outcome), ex=RESULT_TTL_S)
            redis.xack(STREAM, GROUP, entry_id)
            redis.xdel(STREAM, entry_id)
            answered += 1

    def _answer(self, redis, request_id: str, fields: dict) -> dict:
        pending = redis.xpending_range(STREAM, GROUP, min=request_id, max=request_id, count=1)
        if pending and pending[0]["times_delivered"] > MAX_DELIVERIES:
            log.error("image request %s: given up after %d deliveries", request_id, MAX_DELIVERIES)
            return {"status": "failed", "error": f"the worker stopped {MAX_DELIVERIES} times while running it"}
        try:
            request = self.parse(fields)
        except RefusedRequest as error:
            log.warning("image request %s refused: %s", request_id, error)
            return {"status": "refused", "error": str(error)}
        log.info("image request %s: %s", request_id, request.kind)
        try:
            value = self.run(request)
        except RefusedRequest as error:
            log.warning("image request %s refused: %s", request_id, error)
            return {"status": "refused", "error": str(error)}
        except Exception as error:  # the request failed, the worker goes on to the next
            log.exception("image request %s failed", request_id)
            return {"status": "failed", "error": f"{type(error).__name__}: {error}"[-4000:]}
        return {"status": "finished", "result": value}

    @staticmethod
    def parse(fields: dict) -> PullRequest | SifBuildRequest | EnvironmentsRequest:
        raw = fields.get(b"request")
        if set(fields) != {b"request"} or raw is None:
            raise RefusedRequest("an image request is one field 'request' holding JSON (image_jobs.enqueue writes it)")
        if len(raw) > MAX_REQUEST_BYTES:
            raise RefusedRequest(f"an image request is at most {MAX_REQUEST_BYTES} bytes")
        try:
            return _REQUEST.validate_json(raw)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in error.errors()[:5])
            raise RefusedRequest(f"not an image request of kind pull, sif or environments: {problems}") from None

    def _local_source(self, path: str, what: str) -> str:
        found = _below(path, self.source_dirs)
        if found is None:
            allowed = ", ".join(self.source_dirs) or "none"
            raise RefusedRequest(f"{what} {path!r} is not a regular file below this worker's source folders "
                                 f"({allowed}): give the worker --source-dir, or run it with --now")
        return found

    def run(self, request: PullRequest | SifBuildRequest | EnvironmentsRequest) -> Any:
        return _HANDLERS[request.kind](self, request)


def _pull(worker: ImageWorker, request: PullRequest) -> str:
    from rollstream.sandboxes import images

    source = request.source
    scheme, has_scheme, _ = source.partition("://")
    if has_scheme:
        if scheme not in URI_SCHEMES:
            schemes = ", ".join(f"{s}://" for s in URI_SCHEMES)
            raise RefusedRequest(f"a queued pull takes {schemes} URIs, not {scheme}://")
        reference = source.partition("://")[2]
        if scheme.startswith("docker") and not IMAGE_REFERENCE.fullmatch(reference):
            # It reaches the engine's command line ('docker create REFERENCE'): never an option.
            raise RefusedRequest(f"{reference[:100]!r} is not an image reference ([registry/]name[:tag][@digest])")
    else:
        source = worker._local_source(source, "a queued pull's source")
    return images.pull_image(source, request.backend, worker.images_dir)


def _sif(worker: ImageWorker, request: SifBuildRequest) -> str:
    from rollstream.sandboxes import images

    return images.build_image(worker._local_source(request.definition, "a definition file"), request.name,
                              worker.images_dir)


def _environments(worker: ImageWorker, request: EnvironmentsRequest) -> list[dict]:
    # tasks/ builds recipes from SWE records: imported when a build is asked for, not by every image command.
    from rollstream.tasks import swe_env, swe_repos

    for instance in request.instances:
        chosen = sorted({"repo_mirror", "repo_path"} & set(instance))
        if chosen:
            raise RefusedRequest(f"a queued environment build reads the worker's own mirror; the record's {chosen} "
                                 "are not taken from a queue (run 'rollstream images build --now' instead)")
    presets = _harness_presets(worker, request.harnesses)  # refused before anything is built
    mirror = Path(worker.mirror) if worker.mirror else swe_repos.default_mirror()
    built = swe_env.build_for_instances(request.instances, mirror, tuple(request.backends), worker.images_dir,
                                        request.force)
    if presets:
        from rollstream.agent import harness_images

        harness_images.add_layers(built, presets, tuple(request.backends), worker.images_dir)
    return built


def _harness_presets(worker: ImageWorker, names: list[str]) -> list:
    if not names:
        return []
    # agent/ knows the presets: imported when a layer is asked for, not by every image command.
    from rollstream.agent import harness_images

    try:
        return harness_images.harness_presets(names, [Path(folder) for folder in worker.preset_dirs])
    except ValueError as error:  # an unknown preset, or one that installs nothing (PresetError is one)
        raise RefusedRequest(f"{error} (this worker's preset folders: {worker.preset_dirs or 'none'})") from None


_HANDLERS: dict[str, Callable[[ImageWorker, Any], Any]] = {
    "pull": _pull, "sif": _sif, "environments": _environments,
}


def wait_for(redis_url: str, request_id: str, timeout_s: float, poll_s: float = 0.2) -> dict:
    """The outcome of `request_id` once a worker answered it; TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (outcome := result(redis_url, request_id)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no image worker answered request {request_id} in {timeout_s:.0f} s; "
                               "start one with 'rollstream images worker'")
        time.sleep(poll_s)
    return outcome
