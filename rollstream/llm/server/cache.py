"""The built-in server's prefix KV cache: finished sequences leave their keys/values behind so
that the next turn of the same job (whose prompt extends the last one) and the other jobs of
its group (same prompt) skip recomputing the shared prefix. Correctness first, LRU by bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

# One (keys, values) pair per layer, each shaped [1, kv_heads, length, head_dim].
KV = list[tuple[torch.Tensor, torch.Tensor]]


def kv_length(kv: KV) -> int:
    return int(kv[0][0].shape[2]) if kv else 0


def kv_bytes(kv: KV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def kv_slice(kv: KV, length: int) -> KV:
    """The first `length` positions (views; the cache never mutates tensors in place)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]


def kv_compact(kv: KV) -> KV:
    """Own copies, so that a cached entry does not pin the whole batch tensor it was a view of."""
    return [(k.clone(), v.clone()) for k, v in kv]


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(a.numel(), b.numel())
    if n == 0:
        return 0
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


@dataclass
class PrefixHit:
    kv: KV
    length: int


@dataclass
class _Entry:
    ids: torch.Tensor  # CPU int64, the ids whose keys/values `kv` holds
    kv: KV
    nbytes: int


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    entries: int = 0
    bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class PrefixCache:
    """Longest-prefix lookup over the id sequences of finished requests.

    A lookup returns views of an entry's tensors, which stay valid because generation
    appends by concatenation (new tensors), never by writing into cached ones."""

    max_bytes: int = 1 << 30
    min_reuse_tokens: int = 1
    _entries: "OrderedDict[int, _Entry]" = field(default_factory=OrderedDict)
    _next_key: int = 0
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)

    def lookup(self, prompt_ids: list[int]) -> PrefixHit | None:
        """The longest cached prefix of prompt_ids, leaving at least one prompt token to run
        (the model must see it to produce the next token's logits)."""
        prompt = torch.tensor(prompt_ids, dtype=torch.long)
        limit = len(prompt_ids) - 1
        with self._lock:
            self.stats.lookups += 1
            self.stats.prompt_tokens += len(prompt_ids)
            best_key, best_len = None, 0
            for key, entry in self._entries.items():
                n = min(common_prefix_length(entry.ids, prompt), limit)
                if n > best_len:
                    best_key, best_len = key, n
            if best_key is None or best_len < self.min_reuse_tokens:
                return None
            entry = self._entries[best_key]
            self._entries.move_to_end(best_key)
            self.stats.hits += 1
            self.stats.reused_tokens += best_len
            return PrefixHit(kv=kv_slice(entry.kv, best_len), length=best_len)

    def insert(self, ids: list[int], kv: KV) -> None:
        """Remember that `kv` holds the keys/values of `ids` (copied, so views are released)."""
        if not ids or kv_length(kv) != len(ids):
            return
        kv = kv_compact(kv)
        nbytes = kv_bytes(kv)
        if nbytes > self.max_bytes:
            return
        new_ids = torch.tensor(ids, dtype=torch.long)
        with self._lock:
            # Entries that are a prefix of the new one can serve no lookup it cannot.
            for key in [k for k, e in self._entries.items() if e.ids.numel() <= new_ids.numel()
                        and common_prefix_length(e.ids, new_ids) == e.ids.numel()]:
                self._drop(key)
            self._entries[self._next_key] = _Entry(ids=new_ids, kv=kv, nbytes=nbytes)
            self._next_key += 1
            self._bytes += nbytes
            while self._bytes > self.max_bytes and self._entries:
                self._drop(next(iter(self._entries)))
            self.stats.entries = len(self._entries)
            self.stats.bytes = self._bytes

    def clear(self) -> None:
        """Forget everything (new weights make every cached key/value stale)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self.stats.entries = 0
            self.stats.bytes = 0

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key)
        self._bytes -= entry.nbytes
