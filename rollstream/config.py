"""All of rollstream's settings in one place: one pydantic-settings object, read from
environment variables (prefix ``ROLLSTREAM_``, plus plain ``REDIS_URL``) and CLI flags.
Every field documents its unit and default; ``rollstream --help`` shows the same text."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rollstream.sandboxes.policy import DEFAULT_IMAGES, DEFAULT_JOB_OVERRIDES
from rollstream.sandboxes.runtime.env_settings import env_setting

__all__ = ["Settings", "load_settings", "env_setting", "default_swe_mirror"]


def _default_node() -> str:
    return socket.gethostname().split(".")[0] or "node"


def _default_data_dir() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local" / "share")) / "rollstream"


def default_swe_mirror() -> Path:
    """Where the swe task's repository mirror lives unless a job names another."""
    return Path(env_setting("SWE_MIRROR") or Path.home() / ".cache" / "rollstream" / "swe-mirror")


def _default_swe_mirrors() -> list[Path]:
    return [default_swe_mirror()]


HARBOR_MAPPED_IMAGES = ("python", "python:*", "debian", "debian:*", "ubuntu", "ubuntu:*", "buildpack-deps:*")


def _default_harbor_base_images() -> dict[str, str]:
    base = env_setting("BASE_IMAGE", "localhost/rollstream/python:bookworm")
    return {pattern: base for pattern in HARBOR_MAPPED_IMAGES}


class Settings(BaseSettings):
    """Settings shared by the client, the workers and the CLI."""

    model_config = SettingsConfigDict(env_prefix="ROLLSTREAM_", extra="ignore", populate_by_name=True)

    redis_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "ROLLSTREAM_REDIS_URL"),
        description="Redis to use (redis://, rediss://, unix://). Unset: the CLI starts a private "
        "embedded redis-server in data_dir.",
    )
    namespace: str = Field("rs", description="Prefix of every Redis key and stream.")
    node: str = Field(default_factory=_default_node, description="Name of this node; run and eval "
                      "streams are per node because a sandbox lives on one node.")
    data_dir: Path = Field(default_factory=_default_data_dir,
                           description="Folder for the embedded Redis (AOF), sandboxes and outputs.")

    visibility_timeout_s: float = Field(30.0, description="A message idle this long in a consumer's "
                                        "pending list is reclaimed by another worker.")
    heartbeat_interval_s: float = Field(5.0, description="How often a worker refreshes its in-flight "
                                        "messages and its liveness key.")
    worker_ttl_s: float = Field(20.0, description="A worker (and a node) whose heartbeat is older than "
                                "this is considered dead.")
    max_deliveries: int = Field(3, description="A job delivered or failed this many times in a stage "
                                "goes to the dead-letter stream.")
    shutdown_grace_s: float = Field(30.0, description="On SIGTERM, how long in-flight jobs may run "
                                    "before they are handed back to the stream.")
    drain_grace_s: float = Field(60.0, ge=0, description="A node drained ('rollstream drain NODE', POST "
                                 "/v1/nodes/{node}/drain) unless the request says: how long its workers may finish "
                                 "what they hold before they hand it back to init and leave.")
    replica_acks: int = Field(0, ge=0, description="Replicas that must confirm (Redis WAIT) a submission before the "
                              "client is told it was queued, and each stage hand-off before the worker counts it "
                              "done, so an asynchronous failover loses neither. 0 (the default): no wait, for a "
                              "Redis without replicas.")
    replica_ack_timeout_ms: int = Field(1000, gt=0, description="How long one WAIT for replica_acks replicas may "
                                        "take; past it a submission fails (safe to resubmit) and a hand-off waits "
                                        "and asks again.")
    job_state_ttl_s: int = Field(24 * 3600, description="How long a finished job's state hash is kept.")
    results_maxlen: int = Field(1_000_000, description="Approximate cap on each results stream.")
    dead_maxlen: int = Field(100_000, description="Approximate cap on the dead-letter stream.")
    max_sandboxes_per_node: int = Field(64, description="Init pulls work only while this node holds "
                                        "fewer live sandboxes (back-pressure).")
    init_run_ahead: int = Field(4, ge=0, description="Init pulls work only while the node's jobs queued for or at "
                                "work in run, with or without a sandbox, number fewer than its live run slots plus "
                                "this: what waits beyond stays in the shared init stream for a node with room.")
    warm_pool_max_per_node: int = Field(0, ge=0, description="Most warm sandboxes init keeps ready on this node "
                                        "(0: no warm pools), per sandbox spec its jobs asked for lately: as many as "
                                        "the node's run slots that no job's sandbox fills, within the node's memory; "
                                        "and eval as many for the fresh sandboxes tasks verify in, started while "
                                        "the agents work (workers/warm_pool.py).")
    warm_pool_idle_ttl_s: float = Field(300.0, gt=0, description="A warm sandbox no job took within this long "
                                        "is destroyed; a spec no job asked for within it is no longer warmed.")
    warm_pool_check_s: float = Field(0.5, gt=0, description="How often the warm pool tops itself up and renews "
                                     "the leases that keep the node's reaper off its sandboxes.")
    priority_aging_s: float = Field(3.0, gt=0, description="Seconds of queue time one point of a job's "
                                    "priority is worth: init serves waiting jobs by queue time + (100 - "
                                    "priority) * this, so a priority-0 job waits at most 100 * this behind later "
                                    "urgent ones (pipeline/priorities.py).")
    lease_ttl_s: float = Field(60.0, gt=0, description="A backend slot held by a worker that stopped renewing "
                               "it (killed) returns to the balancer after this long.")
    redis_wait_s: float = Field(120.0, description="How long a starting worker waits for Redis to answer.")
    read_block_ms: int = Field(1000, description="XREADGROUP block time; bounds shutdown latency.")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        "auto", description="Event loop of worker processes and the sync client: 'auto' takes uvloop where "
        "it is installed (a fifth less CPU per job than asyncio's own loop), else asyncio's.")
    model_dir: Path | None = Field(None, description="Folder of the served model's tokenizer (and weights, "
                                   "for the built-in server). Run workers tokenize prompts with it.")
    inference_api: Literal["vllm", "sglang", "builtin"] = Field(
        "vllm", description="How run workers speak to backends: 'vllm' (also the built-in server, which "
        "'builtin' names too) or 'sglang'.")
    inference_dead_peer_s: float = Field(15.0, ge=1, description="Seconds after which a run worker gives up on "
                                         "a backend that went silent mid-request (cut off, not refusing): TCP "
                                         "keep-alive probes and TCP_USER_TIMEOUT fail the connection and the turn "
                                         "moves to another backend. A live server's kernel answers the probes "
                                         "however long its generation takes.")
    sandbox_root: Path | None = Field(None, description="Where this node's sandboxes live (default "
                                      "/tmp/rollstream-sb-<uid>).")
    sandbox_backend: str = Field("auto", description="Sandbox backend for tasks that leave it to the node: "
                                 "auto (bubblewrap where it works), bwrap, singularity, docker, local.")
    sandbox_job_overrides: list[str] = Field(
        default_factory=lambda: list(DEFAULT_JOB_OVERRIDES),
        description="SandboxSpec fields a job's `sandbox` may override (JSON list in the environment). "
        "Limits only downwards unless sandbox_job_may_raise_limits. allow_unisolated and the 'local' backend "
        "are never a job's to choose; adding backend, image, network or hide_paths lets jobs change how "
        "their code is confined. A job naming another field fails at init with a message naming it.")
    sandbox_job_may_raise_limits: bool = Field(False, description="Let a job's sandbox overrides raise "
                                               "limits above its task's (more memory, time, processes).")
    sandbox_images: list[str] = Field(
        default_factory=lambda: list(DEFAULT_IMAGES),
        description="Image references a job's sandbox may start from, whether its task took the image from the "
        "instance (a SWE record's image) or the job overrode it (JSON list in the environment): an entry ending "
        "in '/' or ':' admits every reference beginning with it, '*' any reference, another entry that image "
        "alone. Default: the images rollstream builds (localhost/rollstream/...); add e.g. 'docker.io/swebench/' "
        "for SWE-bench's published images. A host folder is not a reference: see sandbox_image_folders.")
    sandbox_image_folders: list[Path] = Field(
        default_factory=list, description="Folders beneath which a job's sandbox may use a host folder (a bwrap "
        "rootfs) or file (a SIF) as its image (JSON list). Empty (the default): the image cache alone "
        "($ROLLSTREAM_IMAGES_DIR, else /var/cache/rollstream/images as root). Symlinks are resolved; the folder "
        "itself, '/' and anything outside are refused.")
    swe_repo_mirrors: list[Path] = Field(
        default_factory=_default_swe_mirrors, description="Folders a swe job's repo_mirror, and a repository it "
        "names by local path, may lie in (JSON list); default: the default mirror alone ($ROLLSTREAM_SWE_MIRROR "
        "or ~/.cache/rollstream/swe-mirror). Any other path fails the job (failure 'job').")
    harbor_task_roots: list[Path] = Field(
        default_factory=list, description="Folders a harbor job's task folder may lie beneath (JSON list; symlinks "
        "resolved). Empty (the default): no harbor job runs; each fails (failure 'job') naming this setting.")
    task_internet: bool = Field(
        False, description="Give the network to sandboxes of tasks that ask for it (a Harbor task.toml's "
        "[environment] allow_internet, true unless it says false): the container engine's private network "
        "(podman's or Docker's bridge, never the host's), so such a task runs on the docker backend whatever "
        "the node's sandbox_backend. Off (the default): a task that says allow_internet = true fails at init "
        "(failure 'job') naming this setting; one that only inherits Harbor's default runs offline, the "
        "trajectory's extra.warnings saying so.")
    openenv_roots: list[Path] = Field(
        default_factory=list, description="Folders an openenv job's environment folder may lie beneath (JSON list; "
        "symlinks resolved). Empty (the default): no openenv job runs; each fails (failure 'job') naming this "
        "setting.")
    nemo_gym_base_image: str = Field(
        "localhost/rollstream/python:trixie", description="The image NeMo Gym's runtime (nemo-gym in a venv) is "
        "built on: it needs Python 3.12+ (scripts/test builds Debian 13's with ROLLSTREAM_BASE_SUITE=trixie "
        "scripts/install-podman).")
    harbor_base_images: dict[str, str] = Field(
        default_factory=_default_harbor_base_images, description="What a harbor task's Dockerfile FROM becomes "
        "when built here, where no registry answers (JSON object in the environment): glob of the image reference "
        "(docker.io/library/ left off) -> a locally built image. Default: python, debian and ubuntu (any tag) -> "
        "$ROLLSTREAM_BASE_IMAGE or localhost/rollstream/python:bookworm (scripts/install-podman). An image no "
        "entry matches is built from as written.")
    verifiers_environments: list[str] = Field(
        default_factory=list, description="verifiers environments (their ids, e.g. 'reverse-text', the module "
        "reverse_text; JSON list) a verifiers job may load: installed packages exposing load_environment, loaded "
        "by id, never from a path. Empty (the default): no verifiers job runs; each fails (failure 'job') naming "
        "this setting.")
    swe_bundle_max_bytes: int = Field(1 << 30, gt=0, description="Largest git bundle of a repository that init "
                                      "reads from the mirror into a sandbox (1 GiB).")
    agent_job_chat_templates: bool = Field(
        False, description="Let a job bring its own Jinja chat template (agent.chat_template_kwargs."
        "chat_template). Off: such a job fails (failure 'job'). On: the template renders in jinja's sandbox, "
        "each rendering bounded by agent_job_chat_template_timeout_s.")
    agent_job_chat_template_timeout_s: float = Field(
        2.0, gt=0, description="Longest a job's own chat template may take to render once; past it the job fails "
        "(failure 'job').")
    reap_interval_s: float = Field(30.0, description="How often eval workers reap sandboxes no job wants.")
    group_affinity_slack: int = Field(2, description="A group's backend is preferred while its in-flight "
                                      "count is within this many of the least loaded.")
    api_max_wait_s: float = Field(30.0, description="Longest long-poll the HTTP API accepts.")
    api_public_docs: bool = Field(False, description="Serve /openapi.json and /docs without the API token "
                                  "(they list every route and model; off by default).")
    max_job_bytes: int = Field(4 * 1024 * 1024, description="Largest accepted job message.")
    door_max_connections: int = Field(256, gt=0, description="Connections a run worker's door server (the "
                                      "harness jobs' OpenAI endpoint) keeps open; past it a new one closes "
                                      "the longest idle, or is answered 503 when all are busy.")
    door_read_timeout_s: float = Field(30.0, gt=0, description="Time a door client has to send a request's "
                                       "head, then its body; a slower one is cut (408).")
    door_keepalive_s: float = Field(300.0, gt=0, description="How long a door connection waits for its next "
                                    "request before it is closed.")
    harness_preset_dirs: list[Path] = Field(
        default_factory=list, description="Folders of harness presets of the operator's own (TOML files, "
        "agent/presets.py; JSON list in the environment), looked up before rollstream's own "
        "(rollstream/data/harnesses); `rollstream harnesses list` shows them.")


def load_settings(**overrides) -> Settings:
    """Settings from the environment with explicit overrides (CLI flags) on top."""
    clean = {k: v for k, v in overrides.items() if v is not None}
    return Settings(**clean)
