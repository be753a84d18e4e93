from textkit import slugify


def test_lowercases():
    assert slugify("Hello") == "hello"


def test_spaces_become_dashes():
    assert slugify("big cat") == "big-cat"
