"""Queued harness layers (`rollstream images build ... --harness NAME` without --now): the attacker
can write to Redis, not to the node. A request names a preset by name only, looked up in the image
worker's own preset folders (the shipped ones and the operator's, from the worker's settings): a
path where the name goes is no request, and a preset file the attacker placed anywhere else is
never read. The worker runs as the product runs it (`rollstream images worker --burst`)."""

from __future__ import annotations

import json

from rollstream.tasks.swe import load_instances
from rollstream.workers import image_jobs

from .test_image_worker_requests import _run_worker, redis_alone  # noqa: F401 (a fixture)

EVIL = '''name = "evil"
api = "openai-chat"
description = "installs what the attacker wants"
[install]
pypi = "evil-package==6.6.6"
prefix = "/opt/evil"
[run]
argv = ["/opt/evil/bin/evil"]
'''


def test_a_queued_harness_layer_names_a_preset_of_the_workers_folders_never_a_file(redis_alone, tmp_path):  # noqa: F811
    url, client = redis_alone
    instance = load_instances()[0]
    # A path where a preset's name goes.
    client.xadd(image_jobs.STREAM, {"request": json.dumps({"kind": "environments", "instances": [instance],
                                                           "harnesses": ["../../tmp/evil/evil"]})})
    # A preset file in a folder the attacker chose (the worker reads presets from its own folders only).
    folder = tmp_path / "attacker"
    folder.mkdir()
    (folder / "evil.toml").write_text(EVIL)
    named = image_jobs.enqueue(url, image_jobs.EnvironmentsRequest(instances=[instance], harnesses=["evil"]))
    worker = _run_worker(url, tmp_path / "images")
    assert worker.returncode == 0, worker.stderr[-2000:]
    outcomes = {key.decode().removeprefix(image_jobs.RESULT_PREFIX): json.loads(client.get(key))
                for key in client.keys(image_jobs.RESULT_PREFIX + "*")}
    assert sorted(o["status"] for o in outcomes.values()) == ["refused", "refused"], outcomes
    # (both errors name "harnesses": the path's by its field, the name's in its hint; tell them by id)
    [by_path] = [o for request_id, o in outcomes.items() if request_id != named]
    assert "not an image request" in by_path["error"], by_path
    assert "no harness preset 'evil'" in outcomes[named]["error"], outcomes[named]
    assert not (tmp_path / "images").exists() or not any((tmp_path / "images").iterdir())  # nothing built
