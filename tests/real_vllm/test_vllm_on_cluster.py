"""The session's vLLM as an inference host of the namespace cluster (issue #33): a rollout node
on a host of its own sends its turns over real TCP (veth, a bridge) to a host whose address
forwards to vLLM's loopback port, so that cutting that host's cable cuts vLLM off; the built-in
server is the other inference host (the driver's address). Here rather than in tests/cluster so
that it shares this folder's session vLLM and built-in server (no start of its own)."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from chaos.net_cluster import NetCluster, backends_of, collect_all
from chaos.netns import Forwarder
from rollstream.client import AsyncClient
from rollstream.llm.balancer import add_backend
from rollstream.tasks import arith

INFERENCE_PORT = 8000


def _loopback(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname == "127.0.0.1" and parts.port, url
    return parts.hostname, parts.port


async def test_a_node_on_the_network_runs_every_turn_on_the_sessions_vllm_and_moves_to_the_builtin_host_when_cut(
        vllm_url, builtin_url, arith_model_dir):
    folder = Path(tempfile.mkdtemp(prefix="rs-net-vllm-", dir="/tmp"))
    cluster = NetCluster(folder, nodes=("n1",))
    driver, vllm_host = cluster.net.hosts["driver"], cluster.net.add_host("vllm")
    forwarders = [
        Forwarder(vllm_host, (vllm_host.address, INFERENCE_PORT), _loopback(vllm_url), source=driver),
        Forwarder(driver, (driver.address, INFERENCE_PORT), _loopback(builtin_url)),
    ]
    on_vllm, on_builtin = (f"http://{host.address}:{INFERENCE_PORT}" for host in (vllm_host, driver))
    try:
        for forwarder in forwarders:
            forwarder.start()
        # A silent backend is given up on after 2 s, not the default 15 s (the same kernel detection, sooner).
        await cluster.start({"ROLLSTREAM_MODEL_DIR": str(arith_model_dir), "ROLLSTREAM_INFERENCE_DEAD_PEER_S": "2"})
        async with AsyncClient(settings=cluster.settings(), submitter="trainer") as client:
            await add_backend(client.r, on_vllm, cluster.namespace)
            ids = [str(s) for s in await client.submit_many([arith.job(i) for i in arith.make_instances(3, seed=7)])]
            results = await collect_all(client, ids, timeout_s=180)
            assert {r.status for r in results} == {"completed"}, [(r.failure, r.error) for r in results]
            assert [backends_of(r) for r in results] == [[on_vllm]] * len(ids)  # every turn on vLLM, over the network

            # Both hosts serve; once a turn is on vLLM, its host's cable is cut mid-turn. A cut is not
            # a crash: the request already sent is neither refused nor answered.
            await add_backend(client.r, on_builtin, cluster.namespace)
            ids = [str(s) for s in await client.submit_many([arith.job(i) for i in arith.make_instances(6, seed=8)])]
            deadline = time.monotonic() + 120
            while not await client.r.zscore(client.keys.backends, on_vllm):
                assert time.monotonic() < deadline, "no turn went to vLLM"
                await asyncio.sleep(0.01)
            cluster.net.cut("vllm")
            results = await collect_all(client, ids, timeout_s=180)
        failed = [(r.failure, r.error) for r in results if r.status != "completed"]
        assert not failed, failed
        turns = [backends_of(r) for r in results]
        assert [on_vllm, on_builtin] in turns, turns  # the job cut off mid-turn finished on the built-in host
        assert all(t in ([on_vllm], [on_builtin], [on_vllm, on_builtin]) for t in turns), turns
    finally:
        cluster.stop()
        for forwarder in forwarders:
            forwarder.stop()
        subprocess.run(["rm", "-rf", str(folder)], check=False)
