"""The built-in server's prefix cache against a brute-force reference, and the bound on the
work of a lookup however many entries it holds."""

from __future__ import annotations

import random

import torch

from rollstream.llm.server import cache as cache_module
from rollstream.llm.server.cache import BLOCK, PrefixCache, kv_length


def _kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    positions = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    return [(positions, -positions)]


def _longest_shared(entries: list[tuple[int, ...]], prompt: list[int]) -> int:
    """The reference: the longest prefix of prompt (less its last id) that any entry holds."""
    best = 0
    for ids in entries:
        n = 0
        for a, b in zip(ids, prompt[:-1]):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best


def test_lookups_agree_with_a_scan_of_every_entry_through_inserts_and_evictions():
    rng = random.Random(7)
    for trial in range(120):
        # A small vocabulary makes sequences share prefixes and diverge inside blocks.
        vocab = rng.choice([2, 3, 5])
        cache = PrefixCache(max_bytes=rng.choice([1 << 30, 2 * 4 * 80]))
        for _step in range(40):
            cached = [e.ids for e in cache._entries.values()]
            if rng.random() < 0.5:
                base = list(rng.choice(cached)) if cached and rng.random() < 0.7 else []
                ids = base[:rng.randint(0, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
                cache.insert(ids, _kv(len(ids)))
                cached = [e.ids for e in cache._entries.values()]
                if 8 * len(ids) <= cache.max_bytes:  # held, alone or by a longer entry
                    assert ids in [list(c[:len(ids)]) for c in cached]
            for a in cached:  # no entry is a prefix of another: the longer one serves all its lookups
                assert not any(a is not b and b[:len(a)] == a for b in cached)
            prompt = (list(rng.choice(cached)) if cached and rng.random() < 0.6 else [])[:rng.randint(0, 3 * BLOCK)]
            prompt += [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
            hit = cache.lookup(prompt)
            want = _longest_shared(cached, prompt)
            assert (hit.length if hit else 0) == want, (trial, prompt, cached)
            if hit:
                assert kv_length(hit.kv) == hit.length
                assert hit.kv[0][0].flatten().tolist() == list(range(hit.length))  # the positions it claims


def test_a_lookup_compares_two_candidates_at_most_however_many_entries_share_its_prefix(monkeypatch):
    """Thousands of entries that share a system prompt and part of a block: a lookup walks
    the shared blocks by hash and compares ids only with the sorted neighbours of its last
    block (a scan over the entries took 63 ms a lookup at 3,000 entries)."""
    rng = random.Random(0)
    system = [rng.randrange(1000) for _ in range(BLOCK + BLOCK // 2)]
    cache = PrefixCache()
    for _ in range(3000):
        ids = system + [rng.randrange(1000) for _ in range(BLOCK)]
        cache.insert(ids, _kv(len(ids)))
    assert cache.stats.entries == 3000
    compared = []
    real_common = cache_module.common_prefix_length
    monkeypatch.setattr(cache_module, "common_prefix_length", lambda a, b: compared.append(1) or real_common(a, b))
    target = cache._entries[next(reversed(cache._entries))].ids
    hit = cache.lookup(list(target) + [1, 2, 3])
    assert hit.length == len(target)
    assert len(compared) <= 2
    compared.clear()
    miss_inside_block = system + [1000]  # an id no entry has, right after the shared ids
    assert cache.lookup(miss_inside_block + [5]).length == len(system)
    assert len(compared) <= 2
