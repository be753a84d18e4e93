"""A worker process and a `rollstream` command start without torch or transformers: they load
only where a model is in hand (the run stage's tokenizer, the built-in server). A module that
imported one at its top made every worker of every pool, and every CLI call, pay seconds of CPU
before doing anything (agent/chat.py's renderer did, through the CLI's demo command)."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("torch", "transformers")
ENTRY_MODULES = ("rollstream.cli.main", "rollstream.workers.process", "rollstream.workers.init",
                 "rollstream.workers.run", "rollstream.workers.eval")


def test_the_cli_and_the_stage_modules_load_neither_torch_nor_transformers():
    code = (f"import sys, {', '.join(ENTRY_MODULES)}\n"
            f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"importing {ENTRY_MODULES} loads {loaded.strip()}"
