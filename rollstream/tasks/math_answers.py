"""Math answer checking for the eval stage of the ``math`` task: pull the final answer out
of a response (the last ``\\boxed{}``), turn LaTeX into plain expressions and compare by
value (integers, decimals, fractions, simple expressions) with sympy where it helps.

Plain functions, no I/O: ``answers_match(predicted, gold)`` is the whole public contract.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

MAX_ANSWER_CHARS = 1000
# sympy may try to evaluate 10**10**10 or 100000! for ever; such answers are compared
# as text only.
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 1000
RELATIVE_TOLERANCE = 1e-9

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _matching_brace(text: str, open_index: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_index``, or None if unbalanced."""
    depth = 0
    for i in range(open_index, len(text)):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            continue
        if ch == "{" and (i == 0 or text[i - 1] != "\\"):
            depth += 1
        elif ch == "}" and (i == 0 or text[i - 1] != "\\"):
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` (nested braces allowed), else None."""
    found = None
    for match in _BOXED.finditer(text or ""):
        close = _matching_brace(text, match.end() - 1)
        if close is not None:
            found = text[match.end():close]
    return found.strip() if found is not None else None


def extract_answer(submitted: object, response_text: str = "") -> str | None:
    """The answer to grade: the submit tool's ``answer`` (unboxed if it holds a
    ``\\boxed{}``), else the last ``\\boxed{}`` of the response text."""
    if isinstance(submitted, dict):
        submitted = submitted.get("answer")
    if isinstance(submitted, (int, float)) and not isinstance(submitted, bool):
        submitted = str(submitted)
    if isinstance(submitted, str) and submitted.strip():
        return last_boxed(submitted) or submitted.strip()
    return last_boxed(response_text)


# -- LaTeX to a plain expression --------------------------------------------------------
_SIMPLE_REPLACEMENTS = [
    (r"\left", ""), (r"\right", ""), (r"\!", ""), (r"\,", ""), (r"\;", ""), (r"\:", ""), (r"\ ", ""),
    (r"\cdot", "*"), (r"\times", "*"), (r"\div", "/"), (r"\pi", "pi"), (r"\infty", "oo"),
    (r"\%", ""), (r"\$", ""), ("^\\circ", ""), (r"^{\circ}", ""), (r"\circ", ""), ("−", "-"),
    (r"\le", "<="), (r"\ge", ">="), ("\\{", "("), ("\\}", ")"),
]
_DROP_COMMANDS = ("\\text", "\\textbf", "\\mathrm", "\\mathbf", "\\operatorname", "\\mbox")


def _take_group(text: str, start: int) -> tuple[str, int]:
    """The argument at ``start``: a braced group or a single character; returns it and the
    index after it. Raises ValueError on unbalanced braces."""
    while start < len(text) and text[start] == " ":
        start += 1
    if start >= len(text):
        raise ValueError("missing argument")
    if text[start] == "{":
        close = _matching_brace(text, start)
        if close is None:
            raise ValueError("unbalanced braces")
        return text[start + 1:close], close + 1
    return text[start], start + 1


def latex_to_expression(text: str) -> str:
    """Rewrite the LaTeX a math answer uses (\\frac, \\sqrt, ^{}, \\cdot, \\text{}, ...)
    into an expression sympy parses. Raises ValueError on malformed input."""
    s = text.strip().strip("$").strip()
    for command in ("\\dfrac", "\\tfrac"):
        s = s.replace(command, "\\frac")
    for command in _DROP_COMMANDS:  # \text{ cm} -> " cm"; units are removed below
        s = s.replace(command + "{", "{")
    out: list[str] = []
    i = 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _take_group(s, i + 5)
            den, i = _take_group(s, i)
            out.append(f"(({latex_to_expression(num)})/({latex_to_expression(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            root = "2"
            if i < len(s) and s[i] == "[":
                close = s.find("]", i)
                if close < 0:
                    raise ValueError("unclosed \\sqrt[")
                root, i = latex_to_expression(s[i + 1:close]), close + 1
            arg, i = _take_group(s, i)
            out.append(f"(({latex_to_expression(arg)})**(1/({root})))")
        elif s[i] == "^":
            arg, i = _take_group(s, i + 1)
            out.append(f"**({latex_to_expression(arg)})")
        elif s[i] == "{":
            inner, i = _take_group(s, i)
            out.append(f"({latex_to_expression(inner)})")
        elif s[i] == "}":
            raise ValueError("unbalanced braces")
        else:
            out.append(s[i])
            i += 1
    s = "".join(out)
    for old, new in _SIMPLE_REPLACEMENTS:
        s = s.replace(old, new)
    return s


_UNIT_AFTER_NUMBER = re.compile(r"(\d)\s*\\(?:text|mbox|mathrm)\{\s*[A-Za-z ]+\}")


def _strip_decorations(text: str) -> str:
    s = text.strip().rstrip(".").strip()
    s = last_boxed(s) or s
    s = _UNIT_AFTER_NUMBER.sub(r"\1", s)  # 5\text{ cm} -> 5
    # "x = 5" or "n=5": the value is the right-hand side.
    if s.count("=") == 1 and "<" not in s and ">" not in s:
        s = s.split("=", 1)[1]
    # Thousands separators: 1,000,000 (only when every group has three digits).
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s.strip()):
        s = s.replace(",", "")
    return s.strip()


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts]


# -- comparison -------------------------------------------------------------------------
def _exact_number(text: str) -> Fraction | None:
    """Integers, decimals, fractions a/b and percentages without sympy."""
    s = text.replace(" ", "")
    m = re.fullmatch(r"\(*([+-]?\d+(?:\.\d*)?|[+-]?\.\d+)\)*(?:/\(*([+-]?\d+(?:\.\d*)?)\)*)?", s)
    if not m:
        return None
    try:
        value = Fraction(m.group(1))
        if m.group(2) is not None:
            den = Fraction(m.group(2))
            if den == 0:
                return None
            value /= den
        return value
    except (ValueError, ZeroDivisionError):
        return None


@dataclass
class _Parsed:
    """A sympy expression that is safe to simplify and evaluate."""

    expr: object


def _too_big(expr) -> bool:
    import sympy

    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp.is_Number and abs(node.exp) > MAX_EXPONENT:
            return True
        if isinstance(node, sympy.Pow) and node.base.is_Number and node.exp.is_Number and \
                abs(node.base) > 1 and abs(node.exp) * len(str(abs(node.base))) > MAX_EXPONENT:
            return True
        if isinstance(node, sympy.Pow) and isinstance(node.exp, sympy.Pow):  # towers: 2**3**4
            return True
        if isinstance(node, sympy.factorial) and node.args[0].is_Number and node.args[0] > MAX_FACTORIAL:
            return True
    return False


def _sympy_parse(text: str) -> _Parsed | None:
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    try:
        expr = parse_expr(text, transformations=transformations, evaluate=False,
                          local_dict={"e": sympy.E, "pi": sympy.pi, "i": sympy.I})
    except Exception:  # sympy raises many kinds (SyntaxError, TokenError, TypeError...)
        return None
    if not isinstance(expr, sympy.Basic) or _too_big(expr):
        return None
    return _Parsed(expr)


def _sympy_equal(a: _Parsed, b: _Parsed) -> bool:
    import sympy

    try:
        diff = sympy.simplify(sympy.sympify(a.expr) - sympy.sympify(b.expr))
        if diff == 0:
            return True
        if diff.free_symbols or diff.is_Rational:  # exact values differ exactly
            return False
        value = complex(sympy.N(diff, 30))
        scale = max(1.0, abs(complex(sympy.N(b.expr, 30))))
        return abs(value) <= RELATIVE_TOLERANCE * scale
    except Exception:  # un-evaluable (relations, sets, zoo): not equal by value
        return False


def normalize(text: str) -> str:
    """A canonical plain-text form: LaTeX rewritten, decorations and spaces removed."""
    s = _strip_decorations(text)
    try:
        s = latex_to_expression(s)
    except ValueError:
        pass
    return re.sub(r"\s+", "", s).lower()


def _values_match(predicted: str, gold: str) -> bool:
    try:
        p_expr, g_expr = latex_to_expression(predicted), latex_to_expression(gold)
    except ValueError:
        return False
    p_num, g_num = _exact_number(p_expr), _exact_number(g_expr)
    if p_num is not None and g_num is not None:
        return p_num == g_num
    p_sym, g_sym = _sympy_parse(p_expr), _sympy_parse(g_expr)
    if p_sym is None or g_sym is None:
        return False
    return _sympy_equal(p_sym, g_sym)


def answers_match(predicted: str | None, gold: str) -> bool:
    """True if ``predicted`` has the same value as ``gold``: 3/4 == 0.75 == \\frac{3}{4},
    \\sqrt{2} == 2^{1/2}, "x = 5" == 5; comma-separated answers compare part by part.
    Malformed, empty or over-long answers are simply wrong."""
    if predicted is None or not str(predicted).strip():
        return False
    predicted, gold = str(predicted), str(gold)
    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    p, g = _strip_decorations(predicted), _strip_decorations(gold)
    if normalize(p) == normalize(g):
        return True
    p_parts, g_parts = _split_top_level(p), _split_top_level(g)
    if len(p_parts) != len(g_parts):
        return False
    if len(g_parts) > 1:
        return all(_values_match(_strip_decorations(a), _strip_decorations(b)) for a, b in zip(p_parts, g_parts))
    return _values_match(p, g)
