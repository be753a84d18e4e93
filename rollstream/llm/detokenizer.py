"""The text of a sequence while it grows, at a cost per token that does not grow with it.

Decoding the whole output again for every new token (to look for stop strings, or to stream
the next piece) costs O(n²) over a sequence: for a few thousand tokens, seconds of the
engine's time. As vLLM's incremental detokenizer does, only a window of the last tokens is
decoded: the text of `ids[prefix:]` less that of `ids[prefix:read]` is what the newest tokens
add, and a character whose bytes are not all generated yet waits for the next token. Used by
the built-in server (stop strings, streaming) and the door (agent/door_stream.py: streaming).
"""

from __future__ import annotations

from typing import Protocol

_INCOMPLETE = "\ufffd"  # what decode gives for the bytes of an unfinished character


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalText:
    """`text` is `tokenizer.decode(ids).rstrip("\\ufffd")` as `append` adds to `ids`, as vLLM's
    detokenizer leaves it (the same for byte-level tokenizers; for any, what vLLM streams)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0  # the window's first id: context for the ids still to be read
        self.read = 0  # ids[:read] are in `text`

    def append(self, token_id: int) -> str:
        """Add a token; returns the text it completes ("" while a character is unfinished)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return ""
        added = after[len(before) :]
        self.text += added
        self.prefix, self.read = self.read, len(self.ids)
        return added

    def catch_up(self, ids: list[int]) -> str:
        """Append what `ids` (this sequence, grown) has beyond `self.ids`; the text it adds."""
        return "".join(self.append(token_id) for token_id in ids[len(self.ids) :])

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
