import json
from collections import Counter
from pathlib import Path


def expected():
    codes = Counter(line.split('"')[2].split()[0] for line in Path("/app/access.log").read_text().splitlines() if line)
    return {**{code: count for code, count in codes.items()}, "total": sum(codes.values())}


def test_summary_exists():
    assert Path("/app/summary.json").is_file()


def test_counts_per_status_code():
    summary = json.loads(Path("/app/summary.json").read_text())
    want = expected()
    assert {k: v for k, v in summary.items() if k != "total"} == {k: v for k, v in want.items() if k != "total"}


def test_total():
    summary = json.loads(Path("/app/summary.json").read_text())
    assert summary["total"] == 240
