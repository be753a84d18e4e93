"""How the bash tool writes a command to its shell: one `eval` of ANSI-C-quoted text between
a prologue that hands on the previous command's `$?` and `$_` and an epilogue that records the
code's status, `$_` and options, so that any text (unclosed quotes, heredocs, non-UTF-8 bytes)
is one command and the framing changes nothing the agent can see. Used by bash_session.py.
"""

from __future__ import annotations

import re

# Keep escaped chunks well below the 4095-byte canonical-mode line limit of a tty.
_CHUNK_CHARS = 1000
_SAFE = re.compile(rb"[^\x20-\x26\x28-\x5b\x5d-\x7e]")


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


# The agent's code runs inside one eval between a prologue and an epilogue. The prologue
# hands the previous command's `$?` and `$_` on through `__rs_pre STATUS LASTARG` (a readonly
# function) in an `&&` list, so that a non-zero status trips neither errexit nor an ERR trap
# (after a status of 0, `:` does it alone, cheaper than a function call).
# The epilogue records the code's status, `$_` and options (the eval's own status is then 0:
# an ERR trap or errexit does not fire twice), turns xtrace off and clears an agent's prompts
# (a venv's activate prepends to PS1), which would print before the next command's output;
# its traces go nowhere (stderr closed), so that no framing is traced. Where the agent had
# xtrace on, the prologue turns it back on, its own traces sent to /dev/null. The epilogue is
# left off where the code has a heredoc, which an unterminated one would swallow it into; its
# blank line ends a trailing backslash continuation.
_PROLOGUE = b'\\__rs_pre "$__rs_s" "${__rs_la-}" && \\builtin : "${__rs_la-}"; '
_PROLOGUE_AFTER_SUCCESS = b'\\builtin : "${__rs_la-}"; '  # `$?` is 0 already: no function call
_EPILOGUE = b'\n\n{ __rs_st=$? __rs_la=$_ __rs_n=%d __rs_t=$- PS0= PS1= PS2=; \\builtin set +x; } 2>&-'
_HEREDOC = re.compile(rb"<<(?!<)")
# By (xtrace, previous status was 0).
_PROLOGUE_ESCAPED = {
    (xtrace, success): ansi_c_escape(
        (b"{ \\builtin set -x; %s} 2>/dev/null; " if xtrace else b"%s")
        % (_PROLOGUE_AFTER_SUCCESS if success else _PROLOGUE)
    )
    for xtrace in (False, True)
    for success in (False, True)
}
_EPILOGUE_ESCAPED = ansi_c_escape(_EPILOGUE)


def encode_command(command: bytes, number: int, xtrace: bool = False, after_success: bool = False) -> bytes:
    """The input line(s) that run `command` as command `number` in the session; `xtrace`:
    the agent had `set -x` on after its last command; `after_success`: that one exited 0."""
    text = _PROLOGUE_ESCAPED[xtrace, after_success] + ansi_c_escape(command)
    if not _HEREDOC.search(command):
        text += _EPILOGUE_ESCAPED % number  # the number again: the code may have set __rs_n
    # Assignments: `$?` is read before they reset it; __rs_st (set by the epilogue) is
    # cleared so that code that never reaches the epilogue reports the eval's status.
    framing = f"__rs_s=${{__rs_st:-$?}} __rs_st= __rs_n={number}"
    if len(text) <= _CHUNK_CHARS:
        return f"{framing}; \\builtin eval $'{text}'\n".encode()
    chunks: list[str] = []
    current = ""
    # Split only between escapes so that a chunk never ends inside "\xHH".
    for token in re.findall(r"\\x[0-9a-f]{2}|[^\\]{1,256}", text):
        if len(current) + len(token) > _CHUNK_CHARS and current:
            chunks.append(current)
            current = ""
        current += token
    chunks.append(current)
    lines = [f"{{ {framing} __rs_c=$'{chunks[0]}'"]
    lines += [f"__rs_c+=$'{chunk}'" for chunk in chunks[1:]]
    lines.append('\\builtin eval "$__rs_c"; }')
    return ("\n".join(lines) + "\n").encode()
