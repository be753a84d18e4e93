"""Test hosts on one machine, joined by a real network: each host is a Linux network namespace
with one veth port on a bridge that lives in a namespace of its own (the switch), so traffic
between hosts crosses real TCP stacks and a port that can be cut, healed, delayed or made
lossy (``tc netem``). The machine's own namespace joins as one more host (the driver: the test
or benchmark process), so it reaches the others without entering a namespace.

Addresses come from 198.18.0.0/15, the range set aside for benchmarking networks (RFC 2544):
every address used is one of these hosts'. Needs root, ``ip`` and ``tc`` (iproute2).
``Network.close()`` (or the context manager) deletes every namespace, which takes its veth
ports with it; processes started in a host are the caller's to stop first."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field


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

    def shape(self, name: str, *, delay_ms: float = 0.0, loss_percent: float = 0.0) -> None:
        """Packets the host sends wait ``delay_ms`` (tc netem) and are lost with
        ``loss_percent`` (netem, or an iptables ``statistic`` rule where the kernel has no
        netem); zeros remove the shaping. Without netem a delay cannot be put on a link:
        put a ``DelayRelay`` in front of the service instead."""
        host = self.hosts[name]
        _ip("tc", "qdisc", "del", "dev", host.device, "root", netns=host.netns, check=False)
        _ip("iptables", "-D", "OUTPUT", "-o", host.device, "-j", "RS_LOSS", netns=host.netns, check=False)
        _ip("iptables", "-F", "RS_LOSS", netns=host.netns, check=False)
        _ip("iptables", "-X", "RS_LOSS", netns=host.netns, check=False)
        if not (delay_ms or loss_percent):
            return
        if self.netem_available():
            args = ["tc", "qdisc", "add", "dev", host.device, "root", "netem"]
            args += ["delay", f"{delay_ms}ms"] if delay_ms else []
            args += ["loss", f"{loss_percent}%"] if loss_percent else []
            _ip(*args, netns=host.netns)
            return
        if delay_ms:
            raise NetworkUnavailable("this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): put a DelayRelay "
                                     "in front of the service to delay its traffic")
        _ip("iptables", "-N", "RS_LOSS", netns=host.netns)
        _ip("iptables", "-A", "RS_LOSS", "-m", "statistic", "--mode", "random", "--probability",
            f"{loss_percent / 100:.4f}", "-j", "DROP", netns=host.netns)
        _ip("iptables", "-I", "OUTPUT", "-o", host.device, "-j", "RS_LOSS", netns=host.netns)

    def close(self) -> None:
        for host in self.hosts.values():
            if host.netns is None:
                _ip("ip", "link", "del", host.device, check=False)
        for name in reversed(self._namespaces):
            _ip("ip", "netns", "del", name, check=False)
        self._namespaces.clear()
        self.hosts.clear()

    def __enter__(self) -> "Network":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- a delay where the kernel has no netem ------------------------------------------------
class DelayRelay:
    """A TCP relay run in a host: every chunk read from either side is written to the other
    ``delay_ms`` later, in order, so each request/response round trip through it takes two
    delays more (what ``netem delay`` on both ends of a link gives). Clients address the
    relay's ``listen`` port instead of the service."""

    def __init__(self, host: Host, listen: tuple[str, int], target: tuple[str, int], delay_ms: float):
        self.host, self.listen, self.target, self.delay_ms = host, listen, target, delay_ms
        self.proc: subprocess.Popen | None = None

    def start(self) -> "DelayRelay":
        argv = [sys.executable, "-m", "chaos.netns", "relay", f"{self.listen[0]}:{self.listen[1]}",
                f"{self.target[0]}:{self.target[1]}", str(self.delay_ms)]
        self.proc = subprocess.Popen(self.host.command(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "listening" once bound
        if "listening" not in line:
            raise NetworkUnavailable(f"the delay relay did not start: {line}{self.proc.stdout.read()}")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


async def _relay(listen: str, target: str, delay_ms: float) -> None:
    delay = delay_ms / 1000
    target_host, target_port = target.rsplit(":", 1)

    async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if chunk is None:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(chunk)
                await writer.drain()
            writer.close()

        sender = asyncio.create_task(deliver())
        try:
            while chunk := await reader.read(65536):
                queue.put_nowait((time.monotonic() + delay, chunk))
        except ConnectionError:
            pass
        queue.put_nowait((0.0, None))
        try:
            await sender
        except ConnectionError:
            pass

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(target_host, int(target_port))
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pump(client_r, server_w), pump(server_r, client_w))

    host, port = listen.rsplit(":", 1)
    server = await asyncio.start_server(handle, host, int(port), backlog=1024)
    print("listening", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "relay":
    asyncio.run(_relay(sys.argv[2], sys.argv[3], float(sys.argv[4])))
