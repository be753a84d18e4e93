"""Starts the IPython kernel inside a sandbox, in place of ipykernel_launcher.

Never imported: backends/common.py sends this file's text as `python -c` (so the image needs
no file of ours) with the kernel's arguments. Each kernel is its own interpreter, so every
module it imports at start is private memory of every sandbox (bench/density.py); it leaves
out at start what no sandbox client uses, and keeps all of it importable by cells. It runs on
the image's Python, which may be far older than ours: no annotations, f-strings or walrus.
"""

import importlib
import importlib.util
import sys
import types

if sys.path and sys.path[0] == "":
    del sys.path[0]


def lazy_package(name, eager):
    """Import package `name` without running its __init__ until it is asked for a name it lacks.

    The public names of its `eager` submodules are there at once. `import jupyter_client` in
    ipykernel would otherwise load its kernel manager, provisioners and their entry points
    (importlib.metadata, zipfile, email): ~40 modules and 1.6 MB a kernel that only speaks
    the protocol. A cell using anything else of the package gets the whole of it.
    """
    spec = importlib.util.find_spec(name)
    if name in sys.modules or spec is None or spec.loader is None or spec.submodule_search_locations is None:
        return
    loader = spec.loader

    class LazyPackage(types.ModuleType):
        def __getattr__(self, attribute):
            self.__class__ = types.ModuleType  # once: a name the package lacks then fails as usual
            exec(loader.get_code(name), self.__dict__)  # noqa: S102
            return getattr(self, attribute)

    module = LazyPackage(name)
    module.__spec__, module.__loader__, module.__file__ = spec, loader, spec.origin
    module.__path__, module.__package__ = spec.submodule_search_locations, name
    sys.modules[name] = module
    try:
        for submodule in eager:
            source = importlib.import_module(name + "." + submodule)
            public = getattr(source, "__all__", [key for key in vars(source) if not key.startswith("_")])
            for key in public:
                module.__dict__[key] = getattr(source, key)
    except Exception:  # noqa: BLE001 - another version of the package: load it whole, as it would be anyway
        del sys.modules[name]


# ipykernel reads connection helpers from jupyter_client's top level, and the blocking client
# class by name (a trait of ConnectionFileMixin).
lazy_package("jupyter_client", ["connect", "blocking"])

# ipykernel imports debugpy at start for the Jupyter debug protocol, which no sandbox client
# speaks: ~110 modules and 8 MB of a kernel's 35 MB. Hidden while ipykernel decides that it
# has no debugger, then given back: a cell that imports debugpy still gets it.
if "debugpy" not in sys.modules:
    sys.modules["debugpy"] = None  # type: ignore[assignment]  # None in sys.modules blocks an import (importlib)
    try:
        import ipykernel.debugger  # noqa: F401
    except ImportError:  # an ipykernel before 6 has no debugger to skip
        pass
    finally:
        del sys.modules["debugpy"]

# ipykernel flushes stdout and stderr after every cell by a round trip to its IO thread
# each, even when nothing was written: two thread wake-ups on the critical path of every
# call, several ms on a busy node. This skips a flush with nothing to send; any other
# ipykernel (attributes missing) keeps its own flush.
#
# Bytes a cell writes to fd 1 or 2 itself (os.write, a C extension, a child process) go
# through a pipe that a thread of ipykernel's drains into the stream. Upstream's flush does
# not wait for that thread, so on a busy node such output arrived after the cell's reply, or
# with the next cell. Here the thread moves bytes from the pipe to the stream under a lock,
# and a flush first waits (up to a second) until the pipe is empty and no bytes are in
# between: everything the cell wrote before it ended is sent with it.
try:
    import fcntl
    import os
    import select
    import struct
    import termios
    import threading
    import time

    from ipykernel.iostream import OutStream

    _flush = OutStream.flush

    def _pipe_lock(stream):
        return stream.__dict__.setdefault("_rollstream_pipe_lock", threading.RLock())

    def _pipe_pending(fid):
        return struct.unpack("i", fcntl.ioctl(fid, termios.FIONREAD, b"\0\0\0\0"))[0]

    def _watch_pipe_fd(self):
        if self._fid is None:
            return
        lock = _pipe_lock(self)
        try:
            while self._should_watch:
                select.select([self._fid], [], [])
                with lock:
                    bts = os.read(self._fid, 65536)
                    if not bts or not self._should_watch:
                        return
                    self.write(bts.decode(errors="replace"))
                os.write(self._original_stdstream_copy, bts)
        except Exception:  # noqa: BLE001 - kept for the stream, as upstream does
            self._exc = sys.exc_info()

    def _drain_pipe(self):
        fid = getattr(self, "_fid", None)
        if fid is None or getattr(self, "watch_fd_thread", None) is None:
            return
        lock = _pipe_lock(self)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with lock:
                try:
                    if _pipe_pending(fid) == 0:
                        return
                except OSError:
                    return
            time.sleep(0.0005)

    def flush(self):
        _drain_pipe(self)
        if (getattr(self, "_flush_pending", True) or getattr(self, "_subprocess_flush_pending", True)
                or getattr(self, "_buffers", True)):
            _flush(self)

    if hasattr(OutStream, "_watch_pipe_fd"):
        OutStream._watch_pipe_fd = _watch_pipe_fd  # type: ignore[method-assign]  # the patch is the point
    OutStream.flush = flush  # type: ignore[method-assign]  # the patch is the point
except Exception:  # noqa: BLE001, S110 - another ipykernel: its own flush stays
    pass

from ipykernel import kernelapp  # noqa: E402 - after OutStream is patched, before it is used

kernelapp.launch_new_instance()
