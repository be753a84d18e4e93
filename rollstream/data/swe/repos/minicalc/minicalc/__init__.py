"""minicalc: evaluate arithmetic expressions."""

from .calc import CalcError, evaluate

__all__ = ["CalcError", "evaluate"]
