"""textkit: small text helpers."""

from .slug import slugify
from .wrap import wrap

__all__ = ["slugify", "wrap"]
