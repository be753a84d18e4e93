"""Fault injection for soak runs and chaos tests: a local deployment whose parts can be
killed (cluster), the faults (faults), load through both doors (load), the accounting
(ledger), leak and memory probes (probes), and the phased run that ties them (soak).

The harness, not the product: it lives beside rollstream/, out of the wheel. `bench/soak.py`
and the tests (pyproject's pytest `pythonpath`) import it from the repository root."""
