import pytest

from minicalc import CalcError, evaluate


def test_addition():
    assert evaluate("1 + 2 + 3") == 6


def test_precedence():
    assert evaluate("2 + 3 * 4") == 14


def test_parentheses():
    assert evaluate("2 * (3 + 4)") == 14


def test_unary_minus():
    assert evaluate("-3 + 5") == 2


def test_unbalanced_parenthesis_is_an_error():
    with pytest.raises(CalcError):
        evaluate("(1 + 2")
