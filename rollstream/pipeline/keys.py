"""Every Redis key and stream name rollstream uses, in one place. The README documents
them for operators; change a name here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

from rollstream.messages import EVAL_STAGE, INIT_STAGE, RUN_STAGE, STAGES

__all__ = ["STAGES", "RESULTS_GROUP", "Keys"]
RESULTS_GROUP = "submitter"


@dataclass(frozen=True)
class Keys:
    """Names under one namespace (default ``rs``)."""

    namespace: str = "rs"

    def _k(self, *parts: str) -> str:
        return ":".join((self.namespace, *parts))

    # Stage streams. Init is shared by all nodes; run and eval are per node because a
    # sandbox lives on the node that made it.
    @property
    def init_stream(self) -> str:
        return self._k("jobs", INIT_STAGE)

    @property
    def init_waiting(self) -> str:
        """Sorted set of jobs waiting for init by rank (priorities.py): readers move the best
        onto the init stream as they read."""
        return self._k(INIT_STAGE, "waiting")

    def run_stream(self, node: str) -> str:
        return self._k("jobs", RUN_STAGE, node)

    def eval_stream(self, node: str) -> str:
        return self._k("jobs", EVAL_STAGE, node)

    def stage_stream(self, stage: str, node: str) -> str:
        return self.init_stream if stage == INIT_STAGE else self._k("jobs", stage, node)

    def results(self, submitter: str) -> str:
        return self._k("results", submitter)

    @property
    def dead(self) -> str:
        return self._k("dead")

    def job(self, job_id: str) -> str:
        return self._k("job", job_id)

    # Cancellation flags: job and group hold "1"; a submitter holds the time of the cancel,
    # which cancels every job of theirs submitted before it.
    def cancel_job(self, job_id: str) -> str:
        return self._k("cancel", "job", job_id)

    def cancel_group(self, group_id: str) -> str:
        return self._k("cancel", "group", group_id)

    def cancel_submitter(self, submitter: str) -> str:
        return self._k("cancel", "submitter", submitter)

    @property
    def cancels(self) -> str:
        """Stream of cancellation notices (one per cancel call), which workers follow to
        keep their in-memory book of cancelled jobs, groups and submitters."""
        return self._k("cancels")

    # Liveness: sorted sets scored by last heartbeat (unix seconds).
    @property
    def workers(self) -> str:
        return self._k("workers")

    def worker(self, worker_id: str) -> str:
        return self._k("worker", worker_id)

    @property
    def nodes(self) -> str:
        return self._k("nodes")

    @property
    def submitters(self) -> str:
        return self._k("submitters")

    def drain(self, node: str) -> str:
        """Present while ``node`` drains: the unix time by which its workers let go (drain.py)."""
        return self._k("drain", node)

    def node_sandboxes(self, node: str) -> str:
        """Set of the sandbox ids live on ``node`` (init's back-pressure)."""
        return self._k("node", node, "sandboxes")

    def node_warm(self, node: str) -> str:
        """Sorted set of the warm-pool sandboxes on ``node`` (workers/warm_pool.py), scored by
        the unix time their lease ends: the node's reaper spares them until then."""
        return self._k("node", node, "warm")

    def stats(self, stage: str) -> str:
        return self._k("stats", stage)

    @property
    def health_probe(self) -> str:
        """Written (with a short expiry) by /health and status: does Redis take writes?"""
        return self._k("health")

    @property
    def policy_version(self) -> str:
        return self._k("policy_version")

    # Latency histograms behind /metrics.
    def stage_histogram(self, stage: str) -> str:
        return self._k("hist", "stage", stage)

    def tool_histogram(self, tool: str) -> str:
        """``tool_histogram("*")`` is the pattern that matches every tool's."""
        return self._k("hist", "tool", tool)

    # The LLM backend balancer (llm/balancer.py and its Lua scripts).
    @property
    def backends(self) -> str:
        """Healthy backends scored by requests in flight (the min-heap acquire pops from)."""
        return self._k("backends")

    @property
    def backends_down(self) -> str:
        """Ejected backends, with the in-flight count they had; acquire skips them."""
        return self._k("backends", "down")

    @property
    def backends_info(self) -> str:
        """Hash: backend URL -> JSON it registered with (and the policy version it serves)."""
        return self._k("backends", "info")

    @property
    def generation_paused(self) -> str:
        """Present while generation is paused (around a weight sync): acquire hands out no slot.
        Holds who paused and why; expires by itself, so a trainer that died never pauses for good."""
        return self._k("backends", "paused")

    @property
    def leases(self) -> str:
        """Sorted set of in-flight slots scored by their expiry (ms), so dead workers' expire."""
        return self._k("leases")

    @property
    def lease_backends(self) -> str:
        """Hash: lease id -> the backend whose slot it holds."""
        return self._k("leases", "backend")

    @property
    def lease_seq(self) -> str:
        return self._k("leases", "seq")

    def job_backend(self, job_id: str) -> str:
        """The backend a job sticks to across its turns (not its state hash: that is ``job``)."""
        return self._k("affinity", "job", job_id)

    def group_backends(self, group_id: str) -> str:
        """Set of the backends a group's jobs went to, which its next jobs prefer (they share
        the prompt: prefix-cache hits)."""
        return self._k("affinity", "group", group_id)
