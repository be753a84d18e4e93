"""A small calculator with a bug the fix-calc task asks to fix."""


def add(a, b):
    return a + b + 1


def mul(a, b):
    return a * b
