import pytest

from textkit import wrap


def test_wraps_at_width():
    assert wrap("the quick brown fox", 10) == ["the quick", "brown fox"]


def test_long_word_gets_own_line():
    assert wrap("a extraordinarily b", 5) == ["a", "extraordinarily", "b"]


def test_width_must_be_positive():
    with pytest.raises(ValueError):
        wrap("x", 0)
