"""How the bash tool writes a command to its shell: one `eval` of ANSI-C-quoted text, so that
any text (unclosed quotes, heredocs, non-UTF-8 bytes) is one command, between a few words that
hand on the previous command's `$?` (and `$_`) and an epilogue that records the code's status
and `$_`, so that the framing changes nothing the agent can see. Used by bash_session.py.

Bash parses every character of the framing on every call (~400 instructions a character
inside the eval), so the common case sends as few words as it can: see bench/README.md (#20).
"""

from __future__ import annotations

import re

# Keep escaped chunks well below the 4095-byte canonical-mode line limit of a tty.
_CHUNK_CHARS = 1000
_SAFE = re.compile(rb"[^\x20-\x26\x28-\x5b\x5d-\x7e]")
_HEREDOC = re.compile(rb"<<(?!<)")
# The pieces a long escaped command is split between: an escape, or a run of other characters.
_CHUNK_TOKEN = re.compile(r"\\x[0-9a-f]{2}|\\.|[^\\]{1,256}")
# Words that may turn xtrace on in the shell itself (`set -x`, `shopt -so xtrace`): such a
# command gets the epilogue that hides itself from xtrace. A function or a sourced file can
# turn it on as well; then the lean epilogue's trace is cut off by the session (strip_trace).
_MAY_TRACE = re.compile(rb"(?<![\w.$/-])(?:set|shopt)(?![\w.-])")
# Commands that read the previous command's `$_`: only these get it put back (a word each
# call costs bash as much as the rest of the framing). The first command of a call is the
# only one that could see it, and it can only do so through one of these spellings.
_READS_LAST_ARG = re.compile(rb"\$_|\$\{_")

# Shell variables of the framing: __rs_n the command's number (PROMPT_COMMAND prints it),
# __rs_s "NUMBER:STATUS" of the code (+ `$-` where the epilogue turned xtrace off), __rs_l
# the code's `$_`; __rs_pre (a readonly function) returns its first argument.
SETUP = (
    "__rs_n=0; __rs_s=; __rs_l=; "
    '__rs_pre() { return "$1"; }; '
    "readonly -f __rs_pre; "
)
# The payload PROMPT_COMMAND prints in the marker: number, status of the last top-level
# command (the eval), the epilogue's record, the shell's options.
MARKER_PAYLOAD = '"$__rs_n:$?:$__rs_s:$-"'
# What PROMPT_COMMAND does after the marker, while the session hands the result on: clear
# an agent's prompts (a venv's activate prepends to PS1), which would print after the marker
# or before the next output. PS2 (continuation lines) is cleared before a chunked command,
# the only framing with any.
AFTER_MARKER = "; PS0= PS1="

# The epilogue records the code's status and `$_` (the eval's own status is then 0: an ERR
# trap does not fire twice); all else waits until after the marker. A blank line before it
# ends a trailing backslash continuation.
_EPILOGUE = "\\n__rs_s={}:$? __rs_l=$_"
# Where xtrace is or may get on: the same in a group whose stderr is closed, so that neither
# it nor PROMPT_COMMAND is traced, recording `$-` (the next command turns xtrace on again).
_EPILOGUE_TRACED = "\\n{{ __rs_s={}:$?$- __rs_l=$_; \\\\builtin set +x; }} 2>&-"


def ansi_c_quote(text: bytes) -> str:
    """`text` as one bash $'...' word."""
    return "$'" + ansi_c_escape(text) + "'"


def _escape(match: re.Match[bytes]) -> bytes:
    byte = match.group(0)[0]
    if byte == 0:
        return b""  # bash strings end at NUL; a NUL in a command is never meaningful
    return b"\\x%02x" % byte


def ansi_c_escape(command: bytes) -> str:
    """The body of a bash $'...' word for `command`."""
    return _SAFE.sub(_escape, command).decode("ascii")


def _restore(status: int, last_arg: bool) -> str:
    """Words that set `$?` to `status` (and `$_` to the code's last one) without tripping
    errexit or an ERR trap: a failing command first in an `&&` list trips neither."""
    word = ' "$__rs_l"' if last_arg else ""
    if status == 0:
        return f"\\builtin :{word};" if last_arg else ""
    if status == 1:
        return f"\\builtin false{word}&&:;"
    return f"\\__rs_pre {status}{word}&&:;"


def encode_command(
    command: bytes, number: int, status: int = 0, xtrace: bool = False, xtrace_on: bool = False
) -> tuple[bytes, bool]:
    """The input line(s) that run `command` as command `number` in the session, after a
    command that exited with `status`; `xtrace`: the agent's `set -x` is in effect; `xtrace_on`:
    it is still on in the shell (a lean epilogue left it). Returns the bytes and whether the
    epilogue is the lean one (whose trace the session cuts off if xtrace got turned on)."""
    escaped = ansi_c_escape(command)
    # (`in` first: a regex search costs more than the rest of a short command's framing)
    last_arg = b"$" in command and _READS_LAST_ARG.search(command) is not None
    lean = not (xtrace or ((b"set" in command or b"shopt" in command) and _MAY_TRACE.search(command)))
    heredoc = b"<<" in command and _HEREDOC.search(command) is not None
    head = "{ \\builtin set +x; } 2>&-;" if xtrace_on else ""
    restore = _restore(status, last_arg or xtrace)
    if xtrace:  # turned on inside the eval: the words above it are not traced
        escaped = ansi_c_escape(b"{ \\builtin set -x; %s} 2>/dev/null\n" % (restore or ":;").encode()) + escaped
        restore = ""
    blank = "\\n" if command.endswith(b"\\") else ""
    if heredoc:
        # An unterminated heredoc would swallow an epilogue: the status is recorded after the
        # eval (`$_` is not), where a heredoc cannot reach.
        tail = f"; {{ __rs_s={number}:$?$-; \\builtin set +x; }} 2>&-"
        text = escaped
    else:
        tail = ""
        text = escaped + blank + (_EPILOGUE if lean else _EPILOGUE_TRACED).format(number)
    if len(text) <= _CHUNK_CHARS:
        return f"{head}__rs_n={number};{restore}\\builtin eval $'{text}'{tail}\n".encode(), lean and not heredoc
    chunks: list[str] = []
    current = ""
    # Split only between escapes so that a chunk never ends inside "\xHH".
    for token in _CHUNK_TOKEN.findall(text):
        if len(current) + len(token) > _CHUNK_CHARS and current:
            chunks.append(current)
            current = ""
        current += token
    chunks.append(current)
    # PS2 would print before each continuation line: cleared by a line of its own first
    # (its marker carries the previous number, so the session skips it).
    lines = [f"{head}PS2=", f"{{ __rs_n={number}; __rs_c=$'{chunks[0]}'"]
    lines += [f"__rs_c+=$'{chunk}'" for chunk in chunks[1:]]
    lines.append(f'{restore}\\builtin eval "$__rs_c"{tail}; }}')
    return ("\n".join(lines) + "\n").encode(), lean and not heredoc


def strip_trace(output: bytes, number: int) -> bytes:
    """Cut off the xtrace lines of a lean epilogue and of PROMPT_COMMAND from `output`, where
    a command turned xtrace on by a way the framing could not foresee (a function, a sourced
    file). They are the last lines: PS4's expansion, then `__rs_s=NUMBER:...`; PS4's
    expansion is taken from the next trace line (`__rs_l=`), as bash prints it for each."""
    at = output.rfind(b"__rs_s=%d:" % number)
    if at < 0:
        return output
    end = output.find(b"\n", at)
    after = output.find(b"__rs_l=", end)
    if end >= 0 and after > end:
        prefix = output[end + 1 : after]
        if prefix and output[at - len(prefix) : at] == prefix:
            at -= len(prefix)
    return output[:at]
