"""Delay and loss on a host's cable (Network.shape) are real to the kernel: its own TCP stack
measures the delay as round-trip time and repairs the loss with retransmits, on this kernel
(no netem) through the userspace wire (chaos/wire.py), where netem exists through netem. The
figures asserted are the kernel's, against the injected ones with a wide margin: the mechanism
is checked, not its speed."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time

import psutil
import pytest

from chaos.netns import Network

DELAY_MS = 100.0
PAYLOAD = 1_000_000  # GSO super-frames (64 KiB) cross the wire, not only MTU-sized ones

SINK = """
import socket, sys
server = socket.create_server((sys.argv[1], 9000))
print("up", flush=True)
while True:
    conn, _ = server.accept()
    received = 0
    while chunk := conn.recv(1 << 20):
        received += len(chunk)
        if received >= int(sys.argv[2]):
            break
    conn.sendall(str(received).encode())
    conn.close()
"""


def tcp_info(sock: socket.socket) -> tuple[float, int]:
    """The kernel's smoothed RTT (ms) and total retransmits of a connection (struct tcp_info:
    tcpi_rtt at byte 68, tcpi_total_retrans at byte 100)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return struct.unpack_from("I", info, 68)[0] / 1000, struct.unpack_from("I", info, 100)[0]


def send_to_sink(address: str) -> tuple[float, int]:
    with socket.create_connection((address, 9000), timeout=120) as conn:
        conn.sendall(b"x" * PAYLOAD)
        assert conn.recv(64) == str(PAYLOAD).encode()  # every byte arrived, whatever was lost on the way
        return tcp_info(conn)


def reconnect(address: str, timeout_s: float = 60.0) -> None:
    """Until a connection succeeds: an address resolution started while the cable was cut fails
    the connections that wait on it (EHOSTUNREACH) until it is made again."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            send_to_sink(address)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def two_hosts():
    with Network() as net:
        net.add_host("driver", driver=True)
        far = net.add_host("far")
        sink = subprocess.Popen(far.command([sys.executable, "-c", SINK, far.address, str(PAYLOAD)]),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert sink.stdout is not None and sink.stdout.readline().strip() == "up"
            yield net, far
        finally:
            sink.kill()
            sink.wait()


def test_delay_and_loss_on_a_cable_are_the_kernels_rtt_and_retransmits_and_go_when_removed(two_hosts):
    net, far = two_hosts
    rtt_ms, _ = send_to_sink(far.address)
    assert rtt_ms < DELAY_MS  # before: the kernel's own veth path

    net.shape("driver", delay_ms=DELAY_MS)
    assert net.netem_available() or net.wired() == ["driver"]
    rtt_ms, _ = send_to_sink(far.address)
    assert DELAY_MS <= rtt_ms < DELAY_MS + 2000, rtt_ms  # a frame is held at least the delay

    net.shape("driver", delay_ms=DELAY_MS, loss_percent=10.0)
    # A transfer may be carried by few (GSO) frames, all of which may pass: a few more tries, not luck.
    for _ in range(8):
        rtt_ms, retransmits = send_to_sink(far.address)
        if retransmits:
            break
    assert retransmits > 0 and rtt_ms >= DELAY_MS, (rtt_ms, retransmits)

    # A cut cable is cut with a wire on it too, and healed.
    net.cut("driver")
    with pytest.raises(OSError):
        socket.create_connection((far.address, 9000), timeout=2).close()
    net.heal("driver")
    reconnect(far.address)

    net.shape("driver")
    assert net.wired() == []
    rtt_ms, _ = send_to_sink(far.address)
    assert rtt_ms < DELAY_MS  # the port is back on the bridge, nothing holds its frames
    net.shape("far", delay_ms=1.0)
    net.shape("driver", loss_percent=1.0)
    assert net.netem_available() or sorted(net.wired()) == ["driver", "far"]
    net.close()  # stops every wire: no process left
    assert not [p for p in psutil.process_iter(["cmdline"]) if net.tag in " ".join(p.info["cmdline"] or [])]
