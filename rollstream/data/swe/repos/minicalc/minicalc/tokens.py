"""Split an expression into numbers, operators and parentheses."""

import re

TOKEN = re.compile(r"\s*(?:(\d+\.\d*|\.\d+|\d+)|(.))")


def tokenize(text):
    tokens = []
    for number, other in TOKEN.findall(text):
        if number:
            tokens.append(float(number) if "." in number else int(number))
        elif other.strip():
            tokens.append(other)
    return tokens
