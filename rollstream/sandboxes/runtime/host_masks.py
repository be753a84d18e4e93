"""The host paths a bwrap plan masks (`--ro-bind /dev/null PATH` over a socket or a file,
`--tmpfs FOLDER` over a folder holding sockets), dropped from the argv where the path has
vanished since the plan was made: bwrap cannot mount over what is gone. Used by supervisor.py.
"""

from __future__ import annotations

import os

if __package__:
    from . import identity
else:  # python -S supervisor.py: sibling modules are top-level
    import identity


def without_vanished_masks(argv: list[str]) -> list[str]:
    """Drop masks whose host path is gone: bwrap could not mount them.

    The bwrap backend masks host files and sockets (`--ro-bind /dev/null PATH`) and folders
    holding sockets (`--tmpfs FOLDER`, then their other entries bound back) that existed when
    the sandbox was planned; one removed since (a Redis that stopped) needs no mask any more.
    """
    if "/dev/null" not in argv and "--tmpfs" not in argv:
        return argv
    options, command = identity.split_options(argv)
    result: list[str] = []
    for option, values in options:
        vanished = bool(values) and not os.path.lexists(values[-1])
        if vanished and ((option == "--ro-bind" and values[0] == "/dev/null")
                         or (option == "--tmpfs" and values[0] not in _STANDARD_TMPFS)):
            continue
        result += [option, *values]
    return result + command


# Starts of a shell retried when a masked host path vanished during the first.
MASK_RACE_RETRIES = 2

# Fresh folders every bwrap sandbox gets, whether or not the host has them.
_STANDARD_TMPFS = ("/root", "/home", "/run", "/tmp")
