"""Root inside a container sandbox that keeps the capabilities a Harbor task's root expects
(SandboxSpec.capabilities: CHOWN, DAC_OVERRIDE, FOWNER, FSETID, SETUID, SETGID, KILL), written
from the attacker's side on real podman: it keeps those and no others, with no-new-privileges; it
cannot mknod, mount, unshare or open host inodes by handle, reaches no host file, process or
/proc knob, cannot read or signal a neighbouring sandbox, and what it leaves in its workdir
(a setuid-root shell) gives no host user root. A job can never ask for capabilities."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from pydantic import ValidationError

from rollstream.sandbox_spec import ROOT_TASK_CAPABILITIES
from rollstream.sandboxes import SandboxClient, SandboxSpec, create_sandbox, destroy_sandbox
from rollstream.sandboxes.backends.docker import DockerBackend, capability_flags, client_env
from rollstream.sandboxes.policy import OverridePolicy, SandboxOverrideRefused

BASE_IMAGE = os.environ.get("ROLLSTREAM_BASE_IMAGE", "localhost/rollstream/python:bookworm")
SECRET = "neighbour-secret-7f3a"


def _engine_with_image() -> bool:
    if not DockerBackend().available():
        return False
    return subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True, timeout=60,
                          env={**os.environ, **client_env()}).returncode == 0


needs_engine = pytest.mark.skipif(not _engine_with_image(),
                                  reason=f"no container engine with {BASE_IMAGE} (scripts/install-podman)")

# Run as root in the attacker's container: each attack's outcome as JSON (an errno name, or what it got).
ATTACKS = r'''
import ctypes, errno, json, os, sys
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def err(e):
    return errno.errorcode.get(e.errno, str(e.errno)) if isinstance(e, OSError) else repr(e)
def attempt(name, fn):
    try:
        out[name] = ["ok", str(fn())[:200]]
    except Exception as e:
        out[name] = ["refused", err(e)]
def sys_call(rc):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return rc
status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\t" in line)
out["uid"] = os.getuid()
out["cap_eff"] = int(status["CapEff"], 16)
out["cap_bnd"] = int(status["CapBnd"], 16)
out["no_new_privs"] = status["NoNewPrivs"].strip()
attempt("mknod_block", lambda: os.mknod("/tmp/sda", 0o600 | 0o060000, os.makedev(8, 0)))
attempt("mknod_char", lambda: os.mknod("/tmp/mem", 0o600 | 0o020000, os.makedev(1, 1)))
attempt("mount_tmpfs", lambda: sys_call(libc.mount(b"none", b"/mnt", b"tmpfs", 0, None)))
attempt("mount_proc", lambda: sys_call(libc.mount(b"proc", b"/mnt", b"proc", 0, None)))
attempt("remount_door_rw", lambda: sys_call(libc.mount(None, b"/run/rollstream-door", None, 32 | 4096 | 0x20, None)))
# The kernel lets any process make a user namespace of its own (all capabilities there) with a
# private mount table: from there, the door stays read-only (a locked mount) and no device is made.
def nested(attack):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            sys_call(libc.unshare(0x10000000 | 0x00020000))
            attack()
            os.write(write, b"ok")
        except Exception as e:
            os.write(write, err(e).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(write)
    got = os.read(read, 100).decode()
    if got != "ok":
        raise OSError(getattr(errno, got, 0) or errno.EIO, got)
    return got
attempt("nested_userns remount_door_rw",
        lambda: nested(lambda: sys_call(libc.mount(None, b"/run/rollstream-door", None, 32 | 4096, None))))
attempt("nested_userns mknod_char", lambda: nested(lambda: os.mknod("/tmp/mem2", 0o600 | 0o020000, os.makedev(1, 1))))
attempt("nested_userns write_door", lambda: nested(lambda: open("/run/rollstream-door/planted", "w").write("x")))
# The "shocker" escape: open_by_handle_at reaches any inode of the host filesystem behind a bind mount.
class Handle(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_uint), ("type", ctypes.c_int), ("f", ctypes.c_ubyte * 128)]
def by_handle():
    handle, mount_id = Handle(128, 0), ctypes.c_int()
    sys_call(libc.name_to_handle_at(-100, os.getcwd().encode(), ctypes.byref(handle), ctypes.byref(mount_id), 0))
    fd = libc.open_by_handle_at(os.open(".", os.O_RDONLY), ctypes.byref(handle), os.O_RDONLY)
    if fd < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return fd
attempt("open_by_handle_at", by_handle)
for knob in ("/proc/sys/kernel/core_pattern", "/proc/sysrq-trigger", "/proc/sys/vm/drop_caches",
             "/sys/kernel/uevent_helper", "/proc/sys/kernel/modprobe"):
    attempt("write " + knob, lambda: open(knob, "w").write("|/tmp/x"))
def nonempty(data):
    if not data:
        raise OSError(errno.ENODATA, "masked: reads empty")
    return data
attempt("read /proc/kcore", lambda: nonempty(open("/proc/kcore", "rb").read(16)))
attempt("chown door", lambda: os.chown("/run/rollstream-door", 1000, 1000))
attempt("write door", lambda: open("/run/rollstream-door/planted", "w").write("x"))
attempt("init_module", lambda: sys_call(libc.syscall(175, None, 0, b"")))
attempt("setns_host_mnt", lambda: sys_call(libc.setns(os.open("/proc/1/ns/mnt", os.O_RDONLY), 0)))
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
out["pids"] = {p: open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:80]
               for p in pids if os.path.exists(f"/proc/{p}/cmdline")}
out["mountinfo"] = open("/proc/self/mountinfo").read()
print(json.dumps(out))
'''


async def _attack(client: SandboxClient) -> dict:
    await client.write_file("/tmp/attack.py", ATTACKS)
    result = await client.bash("python3 /tmp/attack.py", timeout_s=120)
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.fixture
def host_canaries():
    """Host files the attacker would want: a root-only one (0600 in a 0700 folder) and a
    world-writable one, outside every sandbox root."""
    folder = tempfile.mkdtemp(prefix="rs-canary-", dir="/var/tmp")
    private, shared = os.path.join(folder, "root-only"), os.path.join(folder, "world-writable")
    for path, mode in ((private, 0o600), (shared, 0o666)):
        with open(path, "w") as handle:
            handle.write(f"host canary {SECRET}\n")
        os.chmod(path, mode)
    os.chmod(folder, 0o755)
    yield private, shared
    subprocess.run(["rm", "-rf", folder], check=False)


@pytest.fixture
async def root_and_neighbour(sandbox_root):
    """The attacker: root in a container with the root-task capabilities; beside it another sandbox."""
    root_spec = SandboxSpec(backend="docker", image=BASE_IMAGE, capabilities=list(ROOT_TASK_CAPABILITIES))
    handles = [await create_sandbox(root_spec, sandbox_id="capsroot", owner="test", root_dir=sandbox_root),
               await create_sandbox(SandboxSpec(backend="docker", image=BASE_IMAGE), sandbox_id="capsnext",
                                    owner="test", root_dir=sandbox_root)]
    clients = [await SandboxClient(h.socket_path).connect() for h in handles]
    yield list(zip(handles, clients))
    for handle, client in zip(handles, clients):
        await client.close()
        await destroy_sandbox(handle)


_CAP_BITS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "FSETID": 4, "KILL": 5, "SETGID": 6, "SETUID": 7}


def test_a_job_can_never_ask_for_capabilities_and_no_dangerous_one_can_be_named(monkeypatch):
    policy = OverridePolicy(allowed=("limits", "capabilities"))
    with pytest.raises(SandboxOverrideRefused, match="capabilities cannot come from a job"):
        policy.apply(SandboxSpec(backend="docker", image=BASE_IMAGE), {"capabilities": ["CHOWN"]})
    for dangerous in ("SYS_ADMIN", "NET_ADMIN", "NET_RAW", "MKNOD", "SYS_PTRACE", "SYS_MODULE", "DAC_READ_SEARCH"):
        with pytest.raises(ValidationError):
            SandboxSpec(backend="docker", image=BASE_IMAGE, capabilities=[dangerous])
        monkeypatch.setenv("ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES", json.dumps(["CHOWN", dangerous]))
        with pytest.raises(ValueError, match="keeps at most"):
            capability_flags(SandboxSpec(backend="docker", image=BASE_IMAGE, capabilities=["CHOWN"]))
    # The operator narrows what a task gets; [] keeps none even for a root task.
    asked = SandboxSpec(backend="docker", image=BASE_IMAGE, capabilities=list(ROOT_TASK_CAPABILITIES))
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES", "[]")
    assert capability_flags(asked) == ["--cap-drop", "ALL"]
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES", '["CHOWN", "KILL"]')
    assert capability_flags(asked) == ["--cap-drop", "ALL", "--cap-add", "CHOWN", "--cap-add", "KILL"]
    monkeypatch.delenv("ROLLSTREAM_SANDBOX_CONTAINER_CAPABILITIES")
    assert capability_flags(SandboxSpec(backend="docker", image=BASE_IMAGE)) == ["--cap-drop", "ALL"]


@needs_engine
async def test_root_with_the_task_capabilities_cannot_mknod_mount_or_reach_the_host(root_and_neighbour,
                                                                                     host_canaries):
    (handle, attacker), (neighbour, next_client) = root_and_neighbour
    found = await _attack(attacker)
    # Exactly the seven, in the effective and the bounding set, and no way to gain more.
    wanted = sum(1 << _CAP_BITS[name] for name in ROOT_TASK_CAPABILITIES)
    assert found["uid"] == 0 and found["cap_eff"] == wanted and found["cap_bnd"] == wanted, found
    assert found["no_new_privs"] == "1"
    worked = {name: outcome for name, outcome in found.items() if isinstance(outcome, list) and outcome[0] == "ok"}
    assert not worked, f"attacks that worked: {worked}"
    assert found["open_by_handle_at"][1] == "EPERM", found["open_by_handle_at"]
    # Its /proc shows its own processes alone (no host pid, not the neighbour's).
    assert str(os.getpid()) not in found["pids"] and len(found["pids"]) < 20, found["pids"]
    assert not any("pytest" in line or SECRET in line for line in found["pids"].values()), found["pids"]

    # With CHOWN, DAC_OVERRIDE and FOWNER it owns its container; the host canaries stay out of reach.
    private, shared = host_canaries
    hunt = await attacker.bash(
        f"grep -rls {SECRET} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr 2>/dev/null; "
        f"ls {os.path.dirname(private)} 2>&1; chown -R 1000:1000 /run/rollstream-door 2>&1 | head -1; "
        "kill -9 -1; echo done", timeout_s=300)
    assert "done" in hunt.output and SECRET not in hunt.output, hunt.output
    assert "No such file" in hunt.output and "Read-only file system" in hunt.output, hunt.output
    for path in (private, shared):
        info = os.stat(path)
        assert info.st_uid == 0 and Path(path).read_text() == f"host canary {SECRET}\n"
    door = os.stat(os.path.join(os.path.dirname(handle.socket_path), "door"))
    assert door.st_uid == 0, "the read-only door folder changed owner on the host"

    # The neighbour's files: nowhere in the attacker's filesystem, its processes out of signal reach.
    await next_client.write_file("/workspace/secret.txt", f"{SECRET}\n")
    await next_client.write_file("/tmp/secret.txt", f"{SECRET}\n")
    neighbour_paths = [line.split()[3] for line in found["mountinfo"].splitlines()
                       if neighbour.id in line or "capsnext" in line]
    assert neighbour_paths == [], neighbour_paths
    hunt = await attacker.bash(f"grep -rls {SECRET} / --exclude-dir=proc --exclude-dir=sys --exclude-dir=usr "
                               "2>/dev/null; echo searched", timeout_s=300)
    assert hunt.output.strip() == "searched", hunt.output
    assert (await next_client.bash("cat /workspace/secret.txt")).output == f"{SECRET}\n"


@needs_engine
async def test_a_setuid_root_shell_left_in_the_workdir_gives_no_host_user_root(root_and_neighbour):
    (handle, attacker), _ = root_and_neighbour
    planted = await attacker.bash("cp /bin/bash /workspace/rootshell && chown 0:0 /workspace/rootshell && "
                                  "chmod 4755 /workspace/rootshell && stat -c %a /workspace/rootshell")
    assert planted.output.strip() == "4755", planted.output
    host_path = os.path.join(handle.host_workdir, "rootshell")
    assert os.stat(host_path).st_mode & 0o4000  # it is there, setuid, on the host
    # An unprivileged host user can neither reach it (the sandbox folder is root's, 0700) nor, were
    # it copied out by root, gain root from the mount it lies on.
    ran = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "/bin/sh", "-c",
                          f"{host_path} -p -c 'id -u'"], capture_output=True, text=True, timeout=60)
    assert ran.returncode != 0 and "Permission denied" in ran.stderr, (ran.stdout, ran.stderr)
    mounts = subprocess.run(["findmnt", "-n", "-o", "OPTIONS", "--target", host_path], capture_output=True,
                            text=True, timeout=60).stdout
    assert "nosuid" in mounts.split(","), mounts
