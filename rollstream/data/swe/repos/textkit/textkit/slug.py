"""URL slugs."""


def slugify(text):
    """Lower-case ``text`` and replace everything but letters and digits with '-'."""
    out = []
    for ch in text.lower():
        out.append(ch if ch.isascii() and ch.isalnum() else "-")
    return "".join(out)
