"""Fixtures of the door's tests: a started door server, the arith model's tokenizer."""

from __future__ import annotations

import pytest

from rollstream.agent.gateway import Gateway


@pytest.fixture
async def gateway():
    gw = await Gateway().start()
    yield gw
    await gw.aclose()


@pytest.fixture(scope="module")
def tokenizer(arith_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(arith_model_dir)
