"""The local backend: tools run on the host with no isolation, for development only.

It still gives the sandbox its own workdir, a filtered environment and rlimits, but the
processes see the whole host; a spec must opt in with allow_unisolated=True.
"""

from __future__ import annotations

import logging
import os
import sys

from rollstream.sandbox_spec import SandboxSpec

from ..errors import BackendUnavailable
from .base import LaunchPlan, SandboxLayout
from .common import BASH_ARGS, KERNEL_ARGS, base_plan, host_python_path, rlimits_for, sandbox_env

log = logging.getLogger(__name__)


class LocalBackend:
    name = "local"

    def available(self) -> bool:
        return True

    def plan(self, spec: SandboxSpec, layout: SandboxLayout, sandbox_id: str, owner: str) -> LaunchPlan:
        if not spec.allow_unisolated:
            raise BackendUnavailable(
                "backend='local' runs tools on the host without any isolation; set "
                "allow_unisolated=True in the SandboxSpec to accept that (development only)"
            )
        log.warning("sandbox %s uses the local backend: tools run on the host without isolation", sandbox_id)
        # Without mount namespaces the sandbox sees host paths: its workdir is the host folder.
        local_spec = spec.model_copy(update={"workdir": layout.work})
        env = sandbox_env(local_spec, host_python_path())
        env["TMPDIR"] = layout.tmp
        # The host /tmp is shared: keep caches in the sandbox's own tmp folder.
        for key, relative in (("IPYTHONDIR", ".ipython"), ("MPLCONFIGDIR", ".mpl"), ("XDG_CACHE_HOME", ".cache")):
            if key not in spec.env:
                env[key] = os.path.join(layout.tmp, relative)
        return LaunchPlan(
            **base_plan(spec, layout, sandbox_id, owner, self.name),
            workdir_inner=layout.work,
            mounts=[(layout.work, layout.work), (layout.tmp, layout.tmp)],
            bash_argv=list(BASH_ARGS),
            exec_prefix=[],
            kernel_argv=[spec.python or sys.executable, *KERNEL_ARGS],
            kernel_dir_inner=layout.kernel,
            spawn_env=env,
            spawn_cwd=layout.work,
            host_env={"PATH": os.environ.get("PATH", "")},
            rlimits=rlimits_for(spec.limits),
        )
