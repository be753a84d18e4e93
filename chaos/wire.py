"""A host's cable as a userspace wire, for kernels without the netem qdisc: run in the switch's
namespace (chaos/netns.py), it moves Ethernet frames between the host's veth port (taken off the
bridge) and a second veth whose peer sits on the bridge, holding each frame the host sends
``delay_ms`` (± ``jitter_ms``, order kept) and dropping it with ``loss_percent``, as
``netem delay .. loss ..`` on the host's device would. Both ends stay kernel TCP stacks, so
retransmits, RTT estimation and congestion control are the kernel's own.

AF_PACKET sockets with PACKET_VNET_HDR carry each frame with its offload header: a GSO
super-frame (larger than the MTU) or a frame whose checksum the sender left to the device crosses
intact, as it would cross the bridge; a loss drops such a frame whole, as netem does. The
sockets ignore frames they sent themselves (PACKET_IGNORE_OUTGOING).

    python chaos/wire.py HOST_PORT BRIDGE_PORT      (stdin: "delay_ms jitter_ms loss_percent" lines)

Prints "ready" once both sockets are bound; exits when its stdin closes (its owner stopped it or
died). Standard library only."""

from __future__ import annotations

import os
import random
import selectors
import socket
import sys
import time
from collections import deque

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
PACKET_OUTGOING = 4
SO_RCVBUFFORCE = 33
FRAME_BUFFER = 256 * 1024  # a GSO frame (64 KiB and its headers) fits
QUEUE_LIMIT = 10000  # frames in flight on the wire; more are dropped (netem's default limit is 1000)


def open_port(ifname: str) -> socket.socket:
    """A packet socket on ``ifname`` alone: bound before it takes any protocol, so that no
    frame of another interface is queued on it meanwhile."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 * 1024 * 1024)
    sock.bind((ifname, ETH_P_ALL))
    sock.setblocking(False)
    return sock


class Wire:
    def __init__(self, host_port: str, bridge_port: str):
        self.host = open_port(host_port)
        self.bridge = open_port(bridge_port)
        self.delay_s = self.jitter_s = self.loss = 0.0
        self.queue: deque[tuple[float, bytes]] = deque()  # the host's frames, toward the bridge
        self.buffer = bytearray(FRAME_BUFFER)

    def configure(self, line: str) -> None:
        delay_ms, jitter_ms, loss_percent = (float(word) for word in line.split())
        self.delay_s, self.jitter_s, self.loss = delay_ms / 1000, jitter_ms / 1000, loss_percent / 100

    def frames(self, sock: socket.socket):
        while True:
            try:
                size, address = sock.recvfrom_into(self.buffer)
            except BlockingIOError:
                return
            except OSError:
                continue  # the port went down (a cut cable): the kernel reports it once, then hooks it again when up
            if address[2] != PACKET_OUTGOING:
                yield bytes(self.buffer[:size])

    def from_host(self) -> None:
        now = time.monotonic()
        for frame in self.frames(self.host):
            if random.random() < self.loss or len(self.queue) >= QUEUE_LIMIT:
                continue
            due = now + self.delay_s + (random.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0)
            if self.queue and due < self.queue[-1][0]:
                due = self.queue[-1][0]  # jitter never reorders: a later frame leaves no sooner
            self.queue.append((due, frame))

    def to_host(self) -> None:
        for frame in self.frames(self.bridge):
            send(self.host, frame)

    def deliver_due(self) -> float | None:
        """Send the frames whose time has come; seconds until the next one (None: none held)."""
        now = time.monotonic()
        while self.queue and self.queue[0][0] <= now:
            send(self.bridge, self.queue.popleft()[1])
        return max(0.0, self.queue[0][0] - now) if self.queue else None


def send(sock: socket.socket, frame: bytes) -> None:
    try:
        sock.send(frame)
    except OSError:
        pass  # the port is down (a cut cable) or its queue full: the frame is lost, as on a wire


def main(host_port: str, bridge_port: str) -> None:
    wire = Wire(host_port, bridge_port)
    control = sys.stdin.fileno()
    os.set_blocking(control, False)
    selector = selectors.DefaultSelector()
    selector.register(wire.host, selectors.EVENT_READ, wire.from_host)
    selector.register(wire.bridge, selectors.EVENT_READ, wire.to_host)
    selector.register(control, selectors.EVENT_READ, None)
    print("ready", flush=True)
    pending = b""
    timeout: float | None = None
    while True:
        for key, _ in selector.select(timeout):
            if key.data is not None:
                key.data()
                continue
            chunk = os.read(control, 4096)
            if not chunk:
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                wire.configure(line.decode())
        timeout = wire.deliver_due()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
