import pytest

from inventory import Inventory


def test_add_and_count():
    inv = Inventory()
    inv.add("apple", 3)
    inv.add("apple")
    assert inv.count("apple") == 4


def test_remove_some():
    inv = Inventory()
    inv.add("pear", 5)
    inv.remove("pear", 2)
    assert inv.count("pear") == 3


def test_qty_must_be_positive():
    with pytest.raises(ValueError):
        Inventory().add("fig", 0)
