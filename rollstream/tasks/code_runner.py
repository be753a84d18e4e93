"""The test runner of the ``code`` task, run *inside the sandbox* by the eval stage (the
task copies this file there; it imports nothing from rollstream). It loads the agent's
solution, runs each test case with its own time and output limits, and writes a JSON
report to a file named on stdin — so a crash, hang or flood in one case fails that case.

Job on stdin (JSON): {"solution": path, "module": name, "tests": str | [str],
"entry_point": str | null, "per_test_timeout_s": float, "max_output_bytes": int,
"report": path}. The report is JSON lines: {"total": n} (or {"load_error", "total"}),
one {"name", "ok", "error"} per case, then {"done": true}.
"""

from __future__ import annotations

import io
import json
import linecache
import os
import re
import signal
import sys
import traceback
import types
from collections.abc import Callable

ERROR_CHARS = 1500
_TEST_DEF = re.compile(r"^def (test_\w*)\s*\(", re.MULTILINE)
_CHECK_DEF = re.compile(r"^def check\s*\(", re.MULTILINE)


class CaseTimeout(BaseException):
    """Raised by the alarm; a BaseException so that a solution's ``except Exception``
    cannot swallow it."""


class OutputFlood(BaseException):
    """A case printed more than its output limit."""


class BoundedOutput(io.TextIOBase):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.tail = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.size += len(text)
        self.tail = (self.tail + text)[-500:]
        if self.size > self.limit:
            raise OutputFlood(f"printed more than {self.limit} characters (max_output_bytes)")
        return len(text)


def _compile(source: str, filename: str):
    # Registered so tracebacks can quote the failing assert line.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return compile(source, filename, "exec")


def _on_alarm(_signum, _frame):
    raise CaseTimeout()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CaseTimeout):
        return "timed out"
    if isinstance(exc, OutputFlood):
        return str(exc)
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    where = next((f"line {f.lineno}: {f.line}" for f in reversed(frames) if f.filename.startswith("<test")), "")
    where = where.strip()
    return (f"{text} at {where}" if where else text)[:ERROR_CHARS]


def _guarded(fn, timeout_s: float, max_output: int) -> str | None:
    """Run ``fn`` with a time and an output limit; None if it passed, else why not."""
    out = BoundedOutput(max_output)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        fn()
        return None
    except BaseException as exc:  # noqa: BLE001 - SystemExit and friends fail the case too
        return _describe(exc) or type(exc).__name__
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout, sys.stderr = saved


def _load_solution(job: dict) -> tuple[types.ModuleType, str | None]:
    module = types.ModuleType(job["module"])
    module.__file__ = job["solution"]
    sys.modules[job["module"]] = module
    sys.modules.setdefault("solution", module)

    def load():
        with open(job["solution"], encoding="utf-8", errors="replace") as f:
            source = f.read()
        exec(compile(source, job["solution"], "exec"), module.__dict__)

    error = _guarded(load, job["per_test_timeout_s"], job["max_output_bytes"])
    if error is None and job.get("entry_point") and not callable(module.__dict__.get(job["entry_point"])):
        error = f"the solution does not define a function named {job['entry_point']!r}"
    return module, error


def _cases(job: dict, module: types.ModuleType) -> tuple[list[tuple[str, Callable[[], object]]], str | None]:
    """(name, callable) per test case, and an error that fails them all (if the test file
    itself fails). Each string of a list is a case; a single string is one case per
    ``test_*`` function (and ``check(candidate)``) it defines, else one case."""
    base = dict(module.__dict__)
    entry = job.get("entry_point")
    if entry:
        base["candidate"] = module.__dict__[entry]

    def run_snippet(source: str, name: str, ns: dict) -> None:
        exec(_compile(source, f"<test {name}>"), ns)
        for key, value in list(ns.items()):
            if key.startswith("test_") and callable(value) and key not in base:
                value()
        if entry and callable(ns.get("check")) and "check" not in base:
            ns["check"](base["candidate"])

    tests = job["tests"]
    if isinstance(tests, list):

        def snippet(source: str, name: str) -> Callable[[], object]:
            return lambda: run_snippet(source, name, dict(base))

        return [(f"case {i}", snippet(s, f"case {i}")) for i, s in enumerate(tests)], None
    names = _TEST_DEF.findall(tests)
    if entry and _CHECK_DEF.search(tests):
        names.append("check")
    ns = dict(base)
    if not names:
        return [("tests", lambda: run_snippet(tests, "tests", ns))], None
    error = _guarded(lambda: exec(_compile(tests, "<test file>"), ns), job["per_test_timeout_s"],
                     job["max_output_bytes"])

    def case(name: str) -> Callable[[], object]:
        if name == "check":
            return lambda: ns["check"](base["candidate"])
        return lambda: ns[name]()

    cases = [(name, case(name)) for name in names]
    return cases, (f"the tests failed to load: {error}" if error else None)


def main() -> int:
    job = json.loads(sys.stdin.read())
    report_path = job["report"]
    report = open(report_path, "w", encoding="utf-8")  # noqa: SIM115 - opened before any untrusted code runs
    signal.signal(signal.SIGALRM, _on_alarm)
    sys.path.insert(0, os.path.dirname(os.path.abspath(job["solution"])))
    module, load_error = _load_solution(job)

    def emit(entry: dict) -> None:  # one line per case, flushed: a killed run keeps what it did
        report.write(json.dumps(entry) + "\n")
        report.flush()

    if load_error is not None:
        n = len(job["tests"]) if isinstance(job["tests"], list) else 1
        emit({"load_error": load_error, "total": n})
    else:
        cases, tests_error = _cases(job, module)
        emit({"total": len(cases)})
        for name, fn in cases:
            error = tests_error or _guarded(fn, job["per_test_timeout_s"], job["max_output_bytes"])
            emit({"name": name, "ok": error is None, "error": error})
    emit({"done": True})
    report.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
