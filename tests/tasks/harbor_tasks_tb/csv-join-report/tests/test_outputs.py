import csv
from pathlib import Path

REPORT = Path("/app/report.csv")


def rows():
    with REPORT.open(newline="") as handle:
        return list(csv.reader(handle))


def test_header():
    assert rows()[0] == ["name", "orders", "total"]


def test_rows_sorted_by_total():
    assert rows()[1:] == [["Grace", "3", "50.50"], ["Margaret", "1", "12.50"], ["Ada", "2", "12.25"]]


def test_users_without_orders_left_out():
    assert "Linus" not in REPORT.read_text()
