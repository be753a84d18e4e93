"""The stock of a store, item by item."""


class InsufficientStock(ValueError):
    """Raised when more items are removed than are in stock."""


class Inventory:
    def __init__(self):
        self._stock = {}

    def add(self, item, qty=1):
        if qty <= 0:
            raise ValueError("qty must be positive")
        self._stock[item] = self._stock.get(item, 0) + qty

    def remove(self, item, qty=1):
        if qty <= 0:
            raise ValueError("qty must be positive")
        self._stock[item] = self._stock.get(item, 0) - qty

    def count(self, item):
        return self._stock.get(item, 0)

    def items(self):
        return sorted(item for item, n in self._stock.items() if n > 0)
