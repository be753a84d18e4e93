"""What the built-in server spends on text while a sequence grows: looking for stop strings
and streaming need the text after every token. Baseline: decoding the whole output again per
token (what the server did before; O(n²) over a sequence). Now: the incremental detokenizer
(rollstream/llm/detokenizer.py, a window of the last tokens, as vLLM does).

Run: python bench/detokenize.py [--lengths 500,1000,2000,4000]. Uses the tiny model's real
byte-level BPE tokenizer (built in a temporary folder). Prints a table, then
`RESULT {json}` with the milliseconds per sequence of each way and their ratio per length.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from transformers import AutoTokenizer

from rollstream.llm.detokenizer import IncrementalText
from rollstream.llm.tiny_model import build_tiny_model

TEXT = "héllo wörld — the quick brown fox jumps over the lazy dog, 12345 {} 東京 🙂 "


def whole_decode_per_token(tokenizer, ids: list[int]) -> float:
    started = time.perf_counter()
    for count in range(1, len(ids) + 1):
        tokenizer.decode(ids[:count], skip_special_tokens=True).rstrip("\ufffd")
    return time.perf_counter() - started


def incremental(tokenizer, ids: list[int]) -> tuple[float, str]:
    started = time.perf_counter()
    text = IncrementalText(tokenizer)
    text.catch_up(ids)
    return time.perf_counter() - started, text.text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="500,1000,2000,4000", help="output lengths in tokens")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build_tiny_model(folder, seed=0)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    source = tokenizer.encode(TEXT * 400, add_special_tokens=False)
    rows = []
    print(f"{'tokens':>7} {'whole decode per token ms':>26} {'incremental ms':>15} {'ratio':>7}")
    for length in (int(value) for value in args.lengths.split(",")):
        ids = (source * (length // len(source) + 1))[:length]
        whole = whole_decode_per_token(tokenizer, ids)
        took, text = incremental(tokenizer, ids)
        assert text == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        rows.append({"tokens": length, "whole_ms": round(whole * 1e3, 1), "incremental_ms": round(took * 1e3, 1),
                     "ratio": round(whole / took, 1)})
        print(f"{length:7d} {whole * 1e3:26.1f} {took * 1e3:15.1f} {whole / took:7.1f}")
    print("RESULT " + json.dumps({"per_length": rows}))


if __name__ == "__main__":
    main()
