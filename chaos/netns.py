"""Test hosts on one machine, joined by a real network: each host is a Linux network namespace
with one veth port on a bridge that lives in a namespace of its own (the switch), so traffic
between hosts crosses real TCP stacks and a port that can be cut, healed, delayed or made
lossy (``tc netem``, or where the kernel has no netem a userspace wire: chaos/wire.py). The
machine's own namespace joins as one more host (the driver: the test or benchmark process), so
it reaches the others without entering a namespace.

Addresses come from 198.18.0.0/15, the range set aside for benchmarking networks (RFC 2544):
every address used is one of these hosts'. Needs root, ``ip`` and ``tc`` (iproute2).
``Network.close()`` (or the context manager) stops its wires and deletes every namespace, which
takes its veth ports with it; processes started in a host are the caller's to stop first."""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import os
import random
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

WIRE = Path(__file__).with_name("wire.py")
CLONE_NEWNET = 0x40000000


class NetworkUnavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no iproute2)."""


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*prefix, *args], capture_output=True, text=True, check=check, timeout=30)


def _used_subnets() -> set[int]:
    """Third octets of the 198.18.x.0/24 subnets already configured in this namespace."""
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    used = set()
    for word in out.split():
        if word.startswith("198.18."):
            used.add(int(word.split(".")[2]))
    return used


@dataclass
class Host:
    name: str
    netns: str | None  # None: the machine's own namespace (the driver)
    address: str
    port: str  # the switch side of its veth: cut and heal act on it
    device: str  # its own side ("eth0" in a namespace)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` to run in this host (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.netns, *argv] if self.netns else list(argv)


@dataclass
class Network:
    """A switch and its hosts. ``add_host`` makes one; ``cut``/``heal`` a host's port;
    ``shape`` adds delay and loss on a host's own side (its outgoing packets)."""

    tag: str = field(default_factory=lambda: f"rs{os.getpid() % 100000}{random.randrange(100):02d}")
    hosts: dict[str, Host] = field(default_factory=dict)
    subnet: int = 0
    _switch: str = ""
    _namespaces: list[str] = field(default_factory=list)
    _netem: bool | None = None
    _wires: dict[str, subprocess.Popen] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
            raise NetworkUnavailable("network namespace hosts need root and iproute2 (apt-get install iproute2)")
        free = [k for k in range(1, 255) if k not in _used_subnets()]
        self.subnet = random.choice(free)
        self._switch = f"{self.tag}sw"
        self._add_namespace(self._switch)
        _ip("ip", "link", "add", "br0", "type", "bridge", netns=self._switch)
        _ip("ip", "link", "set", "br0", "up", netns=self._switch)

    def _add_namespace(self, name: str) -> None:
        _ip("ip", "netns", "add", name)
        self._namespaces.append(name)
        _ip("ip", "link", "set", "lo", "up", netns=name)

    def address(self, index: int) -> str:
        return str(ipaddress.ip_address(f"198.18.{self.subnet}.0") + index)

    def add_host(self, name: str, *, driver: bool = False) -> Host:
        """A new host (its own namespace), or with ``driver`` the machine's own namespace."""
        index = len(self.hosts) + 1
        port = f"{self.tag}p{index}"
        address = self.address(254 if driver else index)
        if driver:
            device = f"{self.tag}h"
            _ip("ip", "link", "add", device, "type", "veth", "peer", "name", port)
            host = Host(name, None, address, port, device)
        else:
            netns = f"{self.tag}{name}"[:30]
            self._add_namespace(netns)
            _ip("ip", "link", "add", "eth0", "netns", netns, "type", "veth", "peer", "name", port)
            host = Host(name, netns, address, port, "eth0")
        _ip("ip", "link", "set", port, "netns", self._switch)
        _ip("ip", "link", "set", port, "master", "br0", netns=self._switch)
        _ip("ip", "link", "set", port, "up", netns=self._switch)
        _ip("ip", "addr", "add", f"{address}/24", "dev", host.device, netns=host.netns)
        _ip("ip", "link", "set", host.device, "up", netns=host.netns)
        self.hosts[name] = host
        return host

    def cut(self, name: str) -> None:
        """The host's cable pulled: nothing reaches it or leaves it until ``heal``."""
        _ip("ip", "link", "set", self.hosts[name].port, "down", netns=self._switch)

    def heal(self, name: str) -> None:
        _ip("ip", "link", "set", self.hosts[name].port, "up", netns=self._switch)

    def netem_available(self) -> bool:
        """Whether this kernel has the netem qdisc (CONFIG_NET_SCH_NETEM; some cloud kernels
        leave it out, this project's machines among them)."""
        if self._netem is None:
            probe = f"{self.tag}np"
            _ip("ip", "link", "add", probe, "type", "veth", "peer", "name", probe + "b", netns=self._switch)
            self._netem = _ip("tc", "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms",
                              netns=self._switch, check=False).returncode == 0
            _ip("ip", "link", "del", probe, netns=self._switch, check=False)
        return self._netem

    def shape(self, name: str, *, delay_ms: float = 0.0, loss_percent: float = 0.0, jitter_ms: float = 0.0) -> None:
        """Frames the host sends wait ``delay_ms`` (± ``jitter_ms``) and are lost with
        ``loss_percent``: ``tc netem`` on its device where the kernel has netem, else a userspace
        wire on its cable (chaos/wire.py); zeros remove the shaping. Either way both ends keep
        their kernel TCP stacks: what crosses is real frames, retransmitted by the kernel."""
        host = self.hosts[name]
        if self.netem_available():
            _ip("tc", "qdisc", "del", "dev", host.device, "root", netns=host.netns, check=False)
            if delay_ms or loss_percent or jitter_ms:
                args = ["tc", "qdisc", "add", "dev", host.device, "root", "netem"]
                args += ["delay", f"{delay_ms}ms"] + ([f"{jitter_ms}ms"] if jitter_ms else [])
                args += ["loss", f"{loss_percent}%"] if loss_percent else []
                _ip(*args, netns=host.netns)
            return
        if not (delay_ms or loss_percent or jitter_ms):
            self._unwire(name)
            return
        wire = self._wires.get(name) or self._wire(name)
        assert wire.stdin is not None
        wire.stdin.write(f"{delay_ms} {jitter_ms} {loss_percent}\n")
        wire.stdin.flush()

    def wired(self) -> list[str]:
        """Hosts whose cable is a userspace wire now."""
        return [name for name, proc in self._wires.items() if proc.poll() is None]

    def _wire(self, name: str) -> subprocess.Popen:
        """Take the host's port off the bridge and put a wire process between it and a new
        veth whose peer takes its place on the bridge."""
        port = self.hosts[name].port
        _ip("ip", "link", "set", port, "nomaster", netns=self._switch)
        _ip("ip", "link", "add", port + "w", "type", "veth", "peer", "name", port + "b", netns=self._switch)
        _ip("ip", "link", "set", port + "b", "master", "br0", netns=self._switch)
        for device in (port + "w", port + "b"):
            _ip("ip", "link", "set", device, "up", netns=self._switch)
        proc = subprocess.Popen(["ip", "netns", "exec", self._switch, sys.executable, str(WIRE), port, port + "w"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        if (line := proc.stdout.readline()).strip() != "ready":
            proc.kill()
            raise NetworkUnavailable(f"the wire on {name}'s cable did not start: {line}{proc.stdout.read()}")
        self._wires[name] = proc
        return proc

    def _unwire(self, name: str) -> None:
        proc = self._wires.pop(name, None)
        if proc is None:
            return
        _stop(proc)
        if self._switch in self._namespaces:
            port = self.hosts[name].port
            _ip("ip", "link", "del", port + "w", netns=self._switch, check=False)
            _ip("ip", "link", "set", port, "master", "br0", netns=self._switch)

    def close(self) -> None:
        for name in list(self._wires):
            self._unwire(name)
        for host in self.hosts.values():
            if host.netns is None:
                _ip("ip", "link", "del", host.device, check=False)
        for name in reversed(self._namespaces):
            _ip("ip", "netns", "del", name, check=False)
        self._namespaces.clear()
        self.hosts.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(proc: subprocess.Popen) -> None:
    """Stop a wire or forwarder: its stdin closed is its signal to exit; SIGKILL if it lingers."""
    if proc.stdin:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()


# -- a TCP forwarder between hosts -----------------------------------------------------------
class Forwarder:
    """A plain TCP forwarder listening on ``listen`` in ``host`` and connecting to ``target`` from
    ``source``'s namespace (default: the same host): a service on the machine's loopback (the
    session's vLLM) becomes reachable at a host's address, and cutting that host's cable cuts
    the service off. Exits when its owner closes its stdin (``stop``) or dies."""

    def __init__(self, host: Host, listen: tuple[str, int], target: tuple[str, int], source: Host | None = None):
        self.host, self.listen, self.target = host, listen, target
        self.source = source or host
        self.proc: subprocess.Popen | None = None

    def start(self) -> Forwarder:
        argv = [sys.executable, "-m", "chaos.netns", "forward", self.host.netns or "-",
                f"{self.listen[0]}:{self.listen[1]}", f"{self.target[0]}:{self.target[1]}"]
        self.proc = subprocess.Popen(self.source.command(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=str(WIRE.parent.parent))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "listening" once bound
        if "listening" not in line:
            self.proc.kill()
            raise NetworkUnavailable(f"the forwarder did not start: {line}{self.proc.stdout.read()}")
        return self

    def stop(self) -> None:
        if self.proc:
            _stop(self.proc)

    def __enter__(self) -> Forwarder:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _listen_in(netns: str, host: str, port: int) -> socket.socket:
    """A listening socket made in namespace ``netns`` (a socket keeps the namespace it was made
    in), this thread returned to its own namespace afterwards."""
    if netns == "-":
        return socket.create_server((host, port), backlog=1024)
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    other = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(other, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {netns}")
        try:
            return socket.create_server((host, port), backlog=1024)
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back")
    finally:
        os.close(own)
        os.close(other)


async def _forward(netns: str, listen: str, target: str) -> None:
    target_host, target_port = target.rsplit(":", 1)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pump(client_r, server_w), pump(server_r, client_w))

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, sock=_listen_in(netns, host, int(port)))
    print("listening", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the owner closes our stdin
    server.close()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "forward":
    asyncio.run(_forward(sys.argv[2], sys.argv[3], sys.argv[4]))
