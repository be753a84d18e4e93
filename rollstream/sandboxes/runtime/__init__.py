"""The supervisor side of a sandbox: stdlib + msgpack + ptyprocess only.

These modules run inside the detached per-sandbox supervisor process, started with
`python -S` so that it comes up in tens of milliseconds; keep heavy imports out.
"""
