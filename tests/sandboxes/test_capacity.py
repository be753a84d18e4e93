"""How many sandboxes the node holds: a sandbox's memory read from its live processes, and
the capacity the warm pool sizes itself by."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.sandboxes import (
    SandboxClient,
    SandboxSpec,
    capacity,
    create_sandbox,
    destroy_sandbox,
)
from rollstream.sandboxes.capacity import (
    mem_available_mb,
    node_capacity,
    observe,
    sandbox_mb,
    sandboxes_pss_mb,
)

from .conftest import needs_bwrap


@pytest.fixture(autouse=True)
def no_measured_figures(monkeypatch):
    monkeypatch.setattr(capacity, "_measured", {})
    for kind in ("BASH", "KERNEL", "GPU"):
        monkeypatch.delenv(f"ROLLSTREAM_SANDBOX_MB_{kind}", raising=False)


def test_capacity_counts_live_sandboxes_and_what_the_rest_of_memory_holds(monkeypatch):
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_MB_KERNEL", "40")
    assert node_capacity("kernel", live_sandboxes=10, reserve_mb=1000, available_mb=5000) == 10 + 100
    assert node_capacity("kernel", live_sandboxes=0, reserve_mb=1000, available_mb=1039) == 0
    # Below the reserve: the live sandboxes and no more, never a negative room.
    assert node_capacity("kernel", live_sandboxes=7, reserve_mb=3072, available_mb=2000) == 7


def test_capacity_reads_memavailable_from_the_node():
    available = mem_available_mb()
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    assert abs(available * 1024 - int(fields["MemAvailable"].split()[0])) < 1024 * 1024  # others move it
    assert node_capacity("bash", reserve_mb=0) >= int((available - 1024) // sandbox_mb("bash"))


def test_figures_come_from_config_else_defaults_and_bad_ones_say_what_to_set(monkeypatch):
    assert sandbox_mb("kernel") == capacity.DEFAULT_SANDBOX_MB["kernel"]
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_MB_KERNEL", "55.5")
    assert sandbox_mb("kernel") == 55.5
    monkeypatch.setenv("ROLLSTREAM_SANDBOX_MB_KERNEL", "lots")
    with pytest.raises(ValueError, match="ROLLSTREAM_SANDBOX_MB_KERNEL"):
        sandbox_mb("kernel")
    with pytest.raises(ValueError, match="ROLLSTREAM_SANDBOX_MB_GPU"):
        node_capacity("gpu")


@needs_bwrap
async def test_a_live_kernel_is_measured_in_its_sandbox_and_sizes_the_capacity(root_dir):
    handles = await asyncio.gather(
        *(create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id=f"c{i}", root_dir=root_dir) for i in range(2))
    )
    try:
        pids = [handle.supervisor_pid for handle in handles]
        bash_only = sandboxes_pss_mb(pids)
        assert all(size > 0 for size in bash_only.values())
        bash_figure = observe("bash", pids)
        assert sandbox_mb("bash") == bash_figure
        async with SandboxClient(handles[0].socket_path) as sb:
            assert (await sb.ipython("big = bytearray(64 * 2**20); len(big)")).result == str(64 * 2**20)
        with_kernel = sandboxes_pss_mb(pids)
        # The kernel and the 64 MiB its cell holds are counted in its sandbox, not the other.
        assert with_kernel[pids[0]] > bash_only[pids[0]] + 64
        assert with_kernel[pids[1]] < bash_only[pids[1]] + 16
        kernel_figure = observe("kernel", pids[:1])
        assert kernel_figure == pytest.approx(with_kernel[pids[0]], rel=0.1)
        # The largest figure seen is kept: a pool is never sized by its lightest moment.
        assert observe("kernel", pids[1:]) < kernel_figure and sandbox_mb("kernel") == kernel_figure
        assert node_capacity("kernel", live_sandboxes=2, reserve_mb=0, available_mb=10.5 * kernel_figure) == 2 + 10
    finally:
        await asyncio.gather(*(destroy_sandbox(handle) for handle in handles))
    with pytest.raises(ValueError, match="alive"):
        observe("kernel", pids)
