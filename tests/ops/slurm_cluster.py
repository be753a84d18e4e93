"""A real single-node Slurm for the ops tests: munged, slurmctld and slurmd started as root
in a temporary folder with their own ports, config and state, and stopped (no daemon left)
afterwards. Debian's packages: slurmctld slurmd slurm-client munge."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DEBIAN_PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol", "sinfo"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if not shutil.which(b)]


def ensure_installed() -> str | None:
    """Install Debian's Slurm and munge if they are missing; returns why not, or None."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"Slurm is not installed ({', '.join(missing_binaries())} missing) and this is not a root " \
               f"Debian machine; install with: apt-get install {' '.join(DEBIAN_PACKAGES)}"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    proc = subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", *DEBIAN_PACKAGES],
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or missing_binaries():
        return f"apt-get install {' '.join(DEBIAN_PACKAGES)} failed: {proc.stderr[-2000:]}"
    return None


SLURM_CONF = """\
ClusterName=rstest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# No cgroups inside a container: track processes by parentage, bind no CPUs.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Claim more CPUs than the machine has, so a head job and a worker array fit on 2 cores.
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=5
InactiveLimit=0
MinJobAge=300
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=100000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


@dataclass
class SlurmCluster:
    """munged + slurmctld + slurmd rooted at ``root``; use as a context manager."""

    root: Path
    cpus: int = 16
    host: str = field(default_factory=lambda: socket.gethostname().split(".")[0])

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.root.chmod(0o755)
        self.conf.write_text(SLURM_CONF.format(host=self.host, root=self.root, cpus=self.cpus,
                                               ctld_port=free_port(), slurmd_port=free_port()))

    def _run(self, *cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr}\n{self.logs()}")
        return proc

    def logs(self) -> str:
        out = []
        for name in ("log/slurmctld.log", "log/slurmd.log", "munge/munged.log"):
            path = self.root / name
            if path.exists():
                out.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(out)

    def start(self, timeout_s: float = 30.0) -> SlurmCluster:
        self._write_config()
        m = self.root / "munge"
        self._run("munged", "--force", f"--socket={m}/munge.sock", f"--key-file={m}/munge.key",
                  f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed")
        self._run("slurmctld", "-i", "-f", str(self.conf))
        self._run("slurmd", "-f", str(self.conf))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self._run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return self
            time.sleep(0.3)
        raise RuntimeError(f"the Slurm node did not come up (state {state!r})\n{self.logs()}")

    # -- the commands a user types ------------------------------------------------------
    def sbatch(self, *args: str, cwd: Path, env: dict[str, str]) -> str:
        proc = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **env}, cwd=cwd,
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {proc.stderr}\n{self.logs()}")
        return proc.stdout.strip().split(";")[0]

    def scancel(self, *args: str) -> None:
        self._run("scancel", *args)

    def squeue(self) -> list[tuple[str, str]]:
        """(job id as squeue shows it, state) of every queued or running job."""
        out = self._run("squeue", "-h", "-r", "-o", "%i %T").stdout.split("\n")
        return [tuple(line.split()[:2]) for line in out if line.strip()]  # type: ignore[misc]

    # -- teardown -------------------------------------------------------------------------
    def _pid(self, name: str) -> int | None:
        path = self.root / name
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None

    def daemon_pids(self) -> list[int]:
        return [p for p in (self._pid("slurmctld.pid"), self._pid("slurmd.pid"), self._pid("munge/munged.pid")) if p]

    def stop(self, timeout_s: float = 30.0) -> None:
        """Cancel every job, wait for them to end, stop the daemons; nothing is left."""
        if not self.conf.exists():
            return
        pids = self.daemon_pids()
        self._run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._run("squeue", "-h", check=False).stdout.strip():
            time.sleep(0.3)
        self._run("scontrol", "shutdown", check=False)
        m = self.root / "munge"
        deadline = time.monotonic() + timeout_s
        for pid in pids[:2]:
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
        subprocess.run(["munged", "-s", f"--socket={m}/munge.sock"], capture_output=True, timeout=30)
        for pid in pids:
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):  # a daemon that ignored its shutdown must not outlive the test
                os.kill(pid, 9)

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (our child, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
