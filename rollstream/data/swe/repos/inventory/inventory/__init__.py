"""inventory: count items in stock."""

from .store import Inventory, InsufficientStock

__all__ = ["Inventory", "InsufficientStock"]
