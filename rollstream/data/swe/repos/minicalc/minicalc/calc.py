"""A recursive-descent evaluator over the tokens of ``tokens.tokenize``.

Grammar:  expr := term (('+' | '-') term)*
          term := factor (('*' | '/') factor)*
          factor := NUMBER | '-' factor | '(' expr ')'
"""

from .tokens import tokenize


class CalcError(ValueError):
    pass


class _Parser:
    def __init__(self, tokens):
        self.tokens = tokens
        self.pos = 0

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self):
        token = self.peek()
        self.pos += 1
        return token

    def expr(self):
        left = self.term()
        if self.peek() in ("+", "-"):
            op = self.take()
            right = self.expr()
            return left + right if op == "+" else left - right
        return left

    def term(self):
        left = self.factor()
        if self.peek() in ("*", "/"):
            op = self.take()
            right = self.term()
            return left * right if op == "*" else left / right
        return left

    def factor(self):
        token = self.take()
        if token == "-":
            return -self.factor()
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise CalcError("missing closing parenthesis")
            return value
        if isinstance(token, (int, float)) and not isinstance(token, bool):
            return token
        raise CalcError(f"unexpected token {token!r}")


def evaluate(text):
    parser = _Parser(tokenize(text))
    value = parser.expr()
    if parser.peek() is not None:
        raise CalcError(f"unexpected token {parser.peek()!r}")
    return value
