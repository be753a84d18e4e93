"""Every Redis name comes from pipeline/keys.py: each is distinct, lives under the namespace,
and is documented in the README's redis-cli table for operators."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from rollstream.pipeline.keys import Keys

README = Path(__file__).resolve().parents[2] / "README.md"


def _names(keys: Keys) -> dict[str, str]:
    """Attribute -> the name it builds, with every argument given as ``{}``."""
    out = {}
    for attr, member in inspect.getmembers(type(keys)):
        if attr.startswith("_"):
            continue
        if isinstance(member, property):
            out[attr] = getattr(keys, attr)
        elif inspect.isfunction(member):
            arity = len(inspect.signature(member).parameters) - 1
            out[attr] = getattr(keys, attr)(*["{}"] * arity)
    return out


def test_every_key_name_is_distinct_and_under_the_namespace():
    names = _names(Keys("ns"))
    names.pop("stage_stream")  # an alias: init_stream, run_stream or eval_stream by stage
    clashes = {name for name in names.values() if list(names.values()).count(name) > 1}
    assert not clashes, f"two Keys attributes build the same name: {clashes}"
    assert all(name.startswith("ns:") for name in names.values()), names


def test_a_jobs_backend_affinity_is_not_its_state_hash():
    keys = Keys()
    assert keys.job_backend("j1") != keys.job("j1")


def test_the_readme_documents_every_key():
    table = " ".join(re.findall(r"^\| `rs:.*", README.read_text(), re.MULTILINE))
    documented = {re.sub(r"\{[^}]*\}", "{}", name) for name in re.findall(r"`(rs:[^`]*)`", table)}
    names = _names(Keys("rs"))
    missing = {attr: name for attr, name in names.items() if name not in documented and attr != "stage_stream"}
    assert not missing, f"keys missing from the README's redis-cli table: {missing}"
