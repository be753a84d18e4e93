"""Every Redis key and stream name rollstream uses, in one place. The README documents
them for operators; change a name here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

STAGES = ("init", "run", "eval")
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
        return self._k("jobs", "init")

    def run_stream(self, node: str) -> str:
        return self._k("jobs", "run", node)

    def eval_stream(self, node: str) -> str:
        return self._k("jobs", "eval", node)

    def stage_stream(self, stage: str, node: str) -> str:
        return self.init_stream if stage == "init" else self._k("jobs", stage, node)

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

    def node_sandboxes(self, node: str) -> str:
        """Set of the sandbox ids live on ``node`` (init's back-pressure)."""
        return self._k("node", node, "sandboxes")

    def stats(self, stage: str) -> str:
        return self._k("stats", stage)

    @property
    def health_probe(self) -> str:
        """Written (with a short expiry) by /health and status: does Redis take writes?"""
        return self._k("health")

    @property
    def policy_version(self) -> str:
        return self._k("policy_version")

    @property
    def backends(self) -> str:
        return self._k("backends")
