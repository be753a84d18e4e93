"""Names that changed between the transformers releases rollstream runs on, in one place.
transformers 5 renamed a model call's key-value cache from ``past_key_values`` to ``cache``
(argument and output); the old names still work there but log a deprecation warning, which
reached the demo's terminal. Code that passes or reads a cache goes through these two."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from typing import Any


@cache
def _cache_argument(forward: Callable[..., object]) -> str:
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` under the argument name this model's ``forward`` takes."""
    return {_cache_argument(type(model).forward): cache}


def output_cache(output: Any) -> Any:
    """The key-value cache a model call returned, read without the deprecated name."""
    keys = output.keys()
    return output["cache"] if "cache" in keys else output["past_key_values"]
