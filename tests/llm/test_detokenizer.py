"""The incremental detokenizer against a whole decode, on the tiny model's real byte-level
tokenizer: after every token its text is what decoding the whole sequence gives (less an
unfinished character), for multi-byte characters split over tokens, special tokens kept or
skipped, and sequences of random ids; and it decodes windows, not the whole sequence."""

from __future__ import annotations

import random

import pytest

from rollstream.llm.detokenizer import IncrementalText

TEXTS = [
    "plain words, then numbers 12345 and symbols {}[]()<>",
    "héllo wörld — naïve café, 東京タワー, emoji 🙂🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "  leading spaces\n\tand tabs\r\nand a trailing space ",
]


def _whole(tokenizer, ids: list[int], skip: bool) -> str:
    return tokenizer.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")


def _check(tokenizer, ids: list[int], skip: bool) -> None:
    text = IncrementalText(tokenizer, skip)
    added = []
    for count, token_id in enumerate(ids, 1):
        added.append(text.append(token_id))
        assert text.text == _whole(tokenizer, ids[:count], skip), (count, ids[:count])
    assert "".join(added) == text.text


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("source", TEXTS)
def test_text_after_each_token_is_the_whole_decode(tokenizer, source, skip):
    ids = tokenizer.encode(source, add_special_tokens=False)
    special = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    _check(tokenizer, ids + [special] + ids[:5], skip)


def test_random_ids_including_split_characters(tokenizer):
    rng = random.Random(0)
    vocabulary = len(tokenizer)
    for _ in range(20):
        _check(tokenizer, [rng.randrange(vocabulary) for _ in range(60)], skip=True)


def test_each_token_decodes_a_window_not_the_sequence(tokenizer):
    decoded_lengths = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded_lengths.append(len(ids))
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tokenizer.encode(TEXTS[0] * 40, add_special_tokens=False)
    text = IncrementalText(Counting())
    text.catch_up(ids)
    assert text.text == _whole(tokenizer, ids, True)
    assert len(ids) > 400 and max(decoded_lengths) <= 4
