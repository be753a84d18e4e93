"""The math answer checker: value equality across forms, and malformed, huge or nested
input answered quickly and safely."""

from __future__ import annotations

import pytest

from rollstream.tasks.math_answers import answers_match, extract_answer, last_boxed, latex_to_expression

SAME = [
    ("3/4", "0.75"), (r"\frac{3}{4}", "0.75"), (r"\dfrac{3}{4}", "3/4"), ("0.5", r"\tfrac{1}{2}"),
    (r"\sqrt{2}", "2^{1/2}"), (r"2\sqrt{2}", r"\sqrt{8}"), (r"\sqrt[3]{27}", "3"), ("3.0", "3"), ("-3", "-3.0"),
    ("x = 5", "5"), ("1,000", "1000"), (r"50\%", "50"), (r"5\text{ cm}", "5"), ("x+1", "1+x"),
    (r"\pi/2", r"\frac{\pi}{2}"), (r"\left(1, 2\right)", "(1,2)"), ("10^{3}", "1000"), ("1e3", "1000"),
    (r"\frac{\frac{1}{2}}{2}", "1/4"), (r"\boxed{7}", "7"), ("2(3+4)", "14"), (r"6\cdot 7", "42"),
]
DIFFERENT = [
    ("3/5", "0.75"), ("1,2", "2,1"), ("0.3333", "1/3"), ("x+2", "x+1"), ("7", "-7"), ("", "1"), ("   ", "1"),
    (None, "1"), ("abc", "1"), ("1/0", "1"), (r"\frac{1}{", "0.5"), ("{{{{", "1"), ("}}}", "1"), ("(((", "1"),
]


@pytest.mark.parametrize("predicted,gold", SAME)
def test_equal_values_in_different_forms_match(predicted, gold):
    assert answers_match(predicted, gold)


@pytest.mark.parametrize("predicted,gold", DIFFERENT)
def test_different_or_malformed_answers_do_not_match(predicted, gold):
    assert not answers_match(predicted, gold)


@pytest.mark.parametrize("huge", ["9" * 5000, "2^{2^{100}}", "10**10**10", "100000!", "(10^{9})^{9999999}",
                                  r"\frac{" * 200 + "1" + "}{2}" * 200])
def test_huge_answers_are_rejected_without_evaluating_them(huge):
    assert not answers_match(huge, "1")


def test_big_but_reasonable_numbers_compare_exactly():
    assert answers_match("10^{100}", "1" + "0" * 100)
    assert not answers_match("10^{100}+1", "1" + "0" * 100)


def test_last_boxed_handles_nested_braces_and_takes_the_last_one():
    text = r"first \boxed{1}, then \boxed{\frac{1}{\sqrt{2}}} and a broken \boxed{3"
    assert last_boxed(text) == r"\frac{1}{\sqrt{2}}"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxed{}") == ""


def test_the_submitted_answer_wins_over_the_response_text():
    assert extract_answer("42", r"\boxed{7}") == "42"
    assert extract_answer({"answer": r"\boxed{9}"}, "") == "9"
    assert extract_answer(None, r"so \boxed{7}.") == "7"
    assert extract_answer("", r"so \boxed{7}.") == "7"
    assert extract_answer(12, "") == "12"
    assert extract_answer(None, "nothing") is None


def test_latex_rewriting_rejects_unbalanced_braces():
    with pytest.raises(ValueError):
        latex_to_expression(r"\frac{1}{2")
    assert latex_to_expression(r"\frac{1}{2}") == "((1)/(2))"
