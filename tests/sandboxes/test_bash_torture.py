"""The bash tool against what agents do to a shell, through a real bubblewrap sandbox.

Each case is a sequence of calls with what the agent must see; before it the shell gets a
state (a directory, an exported variable, a function) and after it that state must still be
there, and no output may show the tool's framing. The classes are the ones agent runtimes
(SWE-ReX, OpenHands) had reported: `$?` lost between calls, terminal modes (`stty echo`,
`stty sane`, raw mode, `-isig`) showing the framing or breaking interrupts, programs that read
stdin, `set -e`, traps, prompts, helpers shadowed by the agent's names, odd output.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field

import pytest
import pytest_asyncio

from rollstream.sandboxes import (
    SandboxClient,
    SandboxSpec,
    create_sandbox,
    destroy_sandbox,
    reaper,
)
from rollstream.sandboxes.backends.common import BASH_ARGS
from rollstream.sandboxes.runtime.bash_session import BashSession
from rollstream.sandboxes.runtime.bash_terminal import container_pid_namespace
from rollstream.sandboxes.supervisor_spawn import stop_fork_server

from .conftest import needs_bwrap

# One sandbox for the module, a bash session per case: a sandbox per case would cost more
# than the cases.
pytestmark = [needs_bwrap, pytest.mark.asyncio(loop_scope="module")]

ANY = object()
STATE = "mkdir -p /tmp/torture && cd /tmp/torture && export TORTURE_VAR=kept && torture_fn() { echo fn-ok; }"
STATE_CHECK = 'pwd; echo "$TORTURE_VAR"; torture_fn'
STATE_SEEN = "/tmp/torture\nkept\nfn-ok\n"
FRAMING = re.compile(rb"\x1eRS(?!000000000000)[0-9a-f]{12}:")
# A full-screen program: raw mode (no ISIG: a typed Ctrl-C would be input), the alternate
# screen, then it waits for keys; optionally deaf to SIGINT as well.
EDITOR = (
    "python3 -c \"import signal, sys, tty; {ignore}tty.setraw(0); "
    "sys.stdout.write('\\x1b[?1049h\\x1b[2Jediting'); sys.stdout.flush(); sys.stdin.read()\""
)


@dataclass
class Call:
    command: str
    output: object = ANY  # the exact text, or ANY
    exit_code: object = ANY
    contains: list[str] = field(default_factory=list)
    timeout_s: float | None = None
    no_output_timeout_s: float | None = None
    interrupted: bool = False
    note: str = ""


CASES: dict[str, list[Call]] = {
    # -- state the next command reads -------------------------------------------------
    "exit_status_of_a_failed_call_is_the_next_calls_dollar_question": [
        Call("false", "", 1),
        Call('echo "prev=$?"', "prev=1\n", 0),
    ],
    "exit_status_42_survives_into_the_next_call": [Call("(exit 42)", "", 42), Call("echo $?", "42\n", 0)],
    "syntax_error_status_is_the_next_calls_dollar_question": [
        Call("echo 'unclosed", exit_code=2, contains=["unexpected EOF"]),
        Call("echo $?", "2\n", 0),
    ],
    "last_argument_dollar_underscore_survives": [
        Call("echo hello lastarg", "hello lastarg\n", 0),
        Call('echo "last=$_"', "last=lastarg\n", 0),
    ],
    "dollar_question_inside_a_long_command": [
        Call("(exit 3)", "", 3),
        Call('echo "prev=$?" # ' + "x" * 5000, "prev=3\n", 0),
    ],
    # -- terminal modes -----------------------------------------------------------------
    "stty_echo_does_not_show_the_wrapper": [
        Call("stty echo", "", 0),
        Call("echo $((6*7))", "42\n", 0),
        Call("echo " + "y" * 3000 + " | wc -c", "3001\n", 0),
    ],
    "stty_sane_brings_no_crlf": [
        Call("stty sane", "", 0),
        Call("printf 'a\\nb\\n'", "a\nb\n", 0),
        Call("stty sane; printf 'c\\nd\\n'", "c\nd\n", 0),
    ],
    "stty_onlcr_in_the_same_call_brings_no_crlf": [Call("stty onlcr opost; seq 3", "1\n2\n3\n", 0)],
    "stty_minus_icanon_and_minus_opost": [
        Call("stty -icanon -opost -onlcr", "", 0),
        Call("echo ok; echo " + "z" * 5000 + " | wc -c", "ok\n5001\n", 0),
    ],
    "stty_cols_20_is_put_back": [
        Call("stty cols 20 rows 5; stty size", "5 20\n", 0),
        Call("stty size", "50 250\n", 0),
    ],
    "stty_raw_left_behind": [Call("stty raw -echo", "", 0), Call("echo ok; seq 2", "ok\n1\n2\n", 0)],
    "stty_eol_x_does_not_split_the_next_command": [
        Call("stty eol x", "", 0),
        Call("echo xxx; echo \\x78", "xxx\nx78\n", 0),
    ],
    "stty_tostop_does_not_stop_later_background_output": [
        Call("stty tostop", "", 0),
        Call("(echo bg) & wait", contains=["bg\n"], exit_code=0),
    ],
    # -- interrupts whatever the terminal ---------------------------------------------------
    "timeout_with_signals_off_interrupts_and_keeps_the_shell": [
        Call("stty -isig", "", 0),
        Call("sleep 30", exit_code=130, timeout_s=1, interrupted=True, note="timed out"),
        Call("echo after", "after\n", 0),
    ],
    "timeout_in_raw_mode_interrupts_and_keeps_the_shell": [
        Call("stty raw; sleep 30", exit_code=130, timeout_s=1, interrupted=True),
        Call("echo after; seq 2", "after\n1\n2\n", 0),
    ],
    "full_screen_editor_in_raw_mode_is_interrupted": [
        Call(EDITOR.format(ignore=""), timeout_s=1, interrupted=True, contains=["editing"], exit_code=130),
        Call("echo after; seq 2", "after\n1\n2\n", 0),
    ],
    "full_screen_editor_deaf_to_sigint_is_killed_and_the_terminal_put_back": [
        Call(
            EDITOR.format(ignore="signal.signal(signal.SIGINT, signal.SIG_IGN); "),
            timeout_s=1, interrupted=True, exit_code=137, note="killed",
        ),
        Call("echo after; seq 2", "after\n1\n2\n", 0),
    ],
    "no_output_timeout_with_signals_off": [
        Call("stty -isig; echo started; sleep 30", no_output_timeout_s=1, interrupted=True, contains=["started"],
             exit_code=130),
        Call("echo after", "after\n", 0),
    ],
    "read_builtin_does_not_hang_past_the_timeout": [
        Call("read line", timeout_s=1, interrupted=True, exit_code=130),
        Call("echo after", "after\n", 0),
    ],
    "cat_without_a_file_does_not_hang_past_the_timeout": [
        Call("cat", timeout_s=1, interrupted=True, exit_code=130),
        Call("echo after", "after\n", 0),
    ],
    "python_without_a_script_does_not_hang_past_the_timeout": [
        Call("python3", timeout_s=1, interrupted=True),
        Call("echo after", "after\n", 0),
    ],
    "shell_ignoring_sigint_still_gets_its_command_killed": [
        Call("trap '' INT; sleep 30", timeout_s=1, interrupted=True, exit_code=137),
        Call("trap - INT; echo after", "after\n", 0),
    ],
    "busy_loop_in_the_shell_itself_is_interrupted": [
        Call("while :; do :; done", timeout_s=1, interrupted=True, exit_code=130),
        Call("echo after", "after\n", 0),
    ],
    # -- shell options, traps, prompts ------------------------------------------------------
    "set_e_then_a_failure_keeps_directory_variables_and_functions": [
        Call("set -e", "", 0),
        Call("echo one; false; echo two", "one\n", 1, note="errexit"),
        Call("echo after", "after\n", 0),
    ],
    "set_euo_pipefail_left_on": [
        Call("set -euo pipefail", "", 0),
        Call("echo ok", "ok\n", 0),
        Call("false | true", "", 1, note="errexit"),
        Call("echo after", "after\n", 0),
    ],
    "set_u_left_on": [
        Call("set -u", "", 0),
        Call("echo $NOT_SET_ANYWHERE", exit_code=1, contains=["unbound variable"]),
        Call("echo ok", "ok\n", 0),
    ],
    "set_o_pipefail_left_on": [Call("set -o pipefail", "", 0), Call("false | true", "", 1), Call("echo ok", "ok\n", 0)],
    "set_x_traces_the_agents_commands_only": [
        Call("set -x", "", 0),
        Call("echo traced", "echo traced\ntraced\n", 0),
        Call("set +x", "set +x\n", 0),
        Call("echo quiet", "quiet\n", 0),
    ],
    "exit_trap_does_not_print_between_calls": [Call("trap 'echo bye' EXIT", "", 0), Call("echo ok", "ok\n", 0)],
    "err_trap_fires_once_per_failure": [
        Call("trap 'echo err' ERR", "", 0),
        Call("false", "err\n", 1),
        Call("echo ok", "ok\n", 0),
        Call("trap - ERR", "", 0),
    ],
    "debug_trap_keeps_the_tool_working": [
        Call("trap 'echo dbg' DEBUG", exit_code=0),
        Call("echo marked", exit_code=0, contains=["marked\n"]),
        Call("trap - DEBUG", exit_code=0),
        Call("echo ok", "ok\n", 0),
    ],
    "prompt_command_is_the_tools": [
        Call("PROMPT_COMMAND='echo hi'", exit_code=1, contains=["readonly"]),
        Call("echo ok", "ok\n", 0),
    ],
    "prompts_set_by_the_agent_do_not_print": [
        Call("PS1='(venv) $ '; PS0='zero'; PS2='> '; export PS1", "", 0),
        Call("echo ok", "ok\n", 0),
        Call("echo " + "w" * 3000 + " | wc -c", "3001\n", 0),
    ],
    "aliases_named_like_the_tools_helpers": [
        Call("alias __rs_pre='echo hijack' __rs_post='echo hijack' eval='echo no' builtin='echo no'", "", 0),
        Call("echo ok", "ok\n", 0),
        Call("false", "", 1),
        Call('echo "prev=$?"', "prev=1\n", 0),
    ],
    "functions_named_like_the_tools_helpers": [
        Call("printf() { echo fake; }; eval() { echo fake; }; __rs_n() { echo fake; }", "", 0),
        Call("echo ok", "ok\n", 0),
        Call("unset -f printf eval __rs_n; __rs_n=junk __rs_s=junk __rs_l=junk; echo set", "set\n", 0),
        Call("echo ok", "ok\n", 0),
        Call("__rs_n=7 __rs_s=7:0; echo seven", "seven\n", 0),
    ],
    "exec_bash_replaces_the_shell_and_the_tool_carries_on": [
        Call("export -f torture_fn; exec bash --norc", exit_code=0, note="replaced by a new bash"),
        Call("false", "", 1),
        Call('echo "prev=$?"', "prev=1\n", 0),
    ],
    # A function or a sourced file turns xtrace on where the framing cannot see it coming.
    "xtrace_turned_on_by_a_function_or_a_sourced_file_shows_no_framing": [
        Call("trace_on() { set -x; }; printf 'set -x\\n' > on.sh", "", 0),
        Call("trace_on", "", 0),
        Call("echo traced", "echo traced\ntraced\n", 0),
        Call("set +x; PS4='+$LINENO: '", exit_code=0),
        Call("printf partial; . ./on.sh", "partial", 0),
        Call("echo again", exit_code=0, contains=["echo again\n", "again\n"]),
        Call("set +x", exit_code=0),
        Call("echo quiet", "quiet\n", 0),
    ],
    "interactive_bash_inside_the_shell_and_exit_back": [
        Call("bash", exit_code=0, note="interactive bash started inside the shell"),
        Call("cd / && export INNER=in && inner_fn() { echo inner-fn; }; false", "", 1),
        Call('echo "prev=$?" "$INNER" "$PWD"; inner_fn', "prev=1 in /\ninner-fn\n", 0),
        Call("exit 3", exit_code=3, note="back in the outer shell"),
        Call('echo "back=$?" "${INNER-unset}"', "back=3 unset\n", 0),
    ],
    "bash_dash_c_is_not_taken_for_an_interactive_one": [
        Call("bash -c 'sleep 0.5; echo done'", "done\n", 0),
        Call("bash --norc -c 'exit 4'", "", 4),
    ],
    "exec_redirecting_stdout_inside_a_function_keeps_the_framing": [
        Call("quiet() { exec 3>&1 >/dev/null; }; loud() { exec >&3 3>&-; }", "", 0),
        Call("quiet; echo hidden", "", 0),
        Call("loud; echo shown", "shown\n", 0),
    ],
    "exec_redirecting_stdout_keeps_the_framing": [
        Call("exec 3>&1 >/dev/null; echo hidden", "", 0),
        Call("exec >&3 3>&-; echo shown", "shown\n", 0),
    ],
    # -- odd output ---------------------------------------------------------------------------
    "output_without_a_trailing_newline": [Call("printf abc", "abc", 0), Call("echo next", "next\n", 0)],
    "background_job_printing_after_its_call_returns": [
        Call("(sleep 0.3; echo late) &", exit_code=0),
        Call("sleep 1; echo now", exit_code=0, contains=["late\n", "now\n"]),
        Call("echo ok", exit_code=0, contains=["ok\n"]),
    ],
    "huge_single_line_is_truncated_keeping_head_and_tail": [
        Call("head -c 300000 /dev/zero | tr '\\0' x; echo end", exit_code=0,
             contains=["bytes of output elided", "xend\n"]),
        Call("echo ok", "ok\n", 0),
    ],
    "binary_output_with_marker_bytes": [
        Call("head -c 100000 /dev/urandom; printf '\\036RS000000000000:9:0\\036\\0\\377'", exit_code=0),
        Call("echo ok", "ok\n", 0),
    ],
    "escape_sequences_and_carriage_returns_pass_unchanged": [
        Call("printf '\\x1b[2J\\x1b[?1049hx\\ry\\r\\n'", "\x1b[2J\x1b[?1049hx\ry\r\n", 0),
        Call("echo ok", "ok\n", 0),
    ],
    "heredoc_unterminated_shows_no_framing": [
        Call("cat <<EOF\nhello", exit_code=0, contains=["hello\n"]),
        Call("echo ok", "ok\n", 0),
    ],
    "trailing_backslash_continuation": [Call("echo a \\", "a\n", 0), Call("echo ok", "ok\n", 0)],
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared():
    root_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    handle = await create_sandbox(SandboxSpec(backend="bwrap"), sandbox_id="torture", owner="test", root_dir=root_dir)
    try:
        async with SandboxClient(handle.socket_path) as client:
            yield client
    finally:
        await destroy_sandbox(handle)
        await stop_fork_server(root_dir)
        reaper.reap_finished_children()
        shutil.rmtree(root_dir, ignore_errors=True)


@pytest.mark.parametrize("case", list(CASES))
async def test_bash_torture(shared, case):
    try:
        await run_case(shared, case)
    finally:
        await shared.close_session(case)


async def run_case(sb: SandboxClient, case: str) -> None:
    outputs = []
    start = await sb.bash(STATE, session=case)
    assert start.exit_code == 0, start
    for call in CASES[case]:
        result = await sb.bash(
            call.command, timeout_s=call.timeout_s, no_output_timeout_s=call.no_output_timeout_s, session=case
        )
        outputs.append(result.output_bytes)
        where = f"{case}: {call.command[:80]!r} -> {result!r}"
        if call.output is not ANY:
            assert result.output == call.output, where
        if call.exit_code is not ANY:
            assert result.exit_code == call.exit_code, where
        for text in call.contains:
            assert text in result.output, where
        assert result.interrupted == call.interrupted, where
        assert call.note in result.note, where
        assert "restarted" not in result.note and "new one" not in result.note, where
    after = await sb.bash(STATE_CHECK, session=case)
    outputs.append(after.output_bytes)
    assert after.output.endswith(STATE_SEEN), f"{case}: state lost: {after!r}"
    assert after.exit_code == 0
    for output in outputs:  # no framing: helpers' names or a marker (but the case's own fake one)
        assert b"__rs" not in output and not FRAMING.search(output), (case, output[-300:])


async def test_exec_of_a_program_ends_the_shell_and_the_next_call_gets_a_new_one(shared):
    await shared.bash(STATE, session="exec")
    replaced = await shared.bash("exec python3 -c 'print(1)'", session="exec")
    assert replaced.output == "1\n" and "exited" in replaced.note
    again = await shared.bash("pwd; echo ok", session="exec")
    assert again.output == "/workspace\nok\n" and "new one" in again.note


async def test_an_engine_answer_this_host_cannot_confirm_names_no_namespace():
    """A remote engine's pids, or an answer that is not a container's: nothing is reached."""
    env = {"PATH": os.environ["PATH"]}
    stranger = "a" * 64  # an id no cgroup here is named by
    assert container_pid_namespace(["echo", f"1 {stranger}"], env) is None
    assert container_pid_namespace(["echo", f"{os.getpid()} {stranger}"], env) is None
    assert container_pid_namespace(["echo", "1 not-an-id"], env) is None
    assert container_pid_namespace(["false"], env) is None


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script is not installed")
async def test_a_shell_is_reached_only_in_the_namespace_its_engine_named():
    """The shell names its pid, the engine its namespace: a pid that is not the shell's in
    that namespace (a lie, or another namespace's process) is never reached."""
    inner = " ".join(BASH_ARGS)
    session = BashSession(["script", "-qfec", inner, "/dev/null"], {"PATH": os.environ["PATH"]}, "/tmp", {}, 65536,
                          inside_namespace="pid:[1]")
    session.start()
    try:
        assert "stty before each prompt" in session.terminal_kind
        assert session.run(b"stty echo; echo $((6*7))", 10, None)["output"] == b"42\n"
    finally:
        session.close()


@pytest.mark.skipif(shutil.which("script") is None, reason="util-linux script is not installed")
@pytest.mark.parametrize("reach_inside", [True, False], ids=["inner-pty-reached", "stty-per-prompt"])
async def test_framing_behind_a_pty_of_another_program_with_echo_and_crlf_on(reach_inside):
    """`docker exec -t` runs bash on a pty of its own, made inside the container with echo
    and CRLF on, and relays ours raw: util-linux `script` does the same on this host. Both
    ways: that pty reached from here (its modes put back, its foreground job signalled
    directly), and, where it cannot be, the shell's own stty before each prompt and signals
    from a second shell started beside it."""
    inner = " ".join(BASH_ARGS)
    session = BashSession(
        ["script", "-qfec", inner, "/dev/null"], {"PATH": os.environ["PATH"]}, "/tmp", {}, 65536, interrupt_grace_s=1.0,
        inside_namespace=os.readlink("/proc/self/ns/pid") if reach_inside else None,
    )
    session.start()
    try:
        expected = "reached from the host" if reach_inside else "stty before each prompt"
        assert expected in session.terminal_kind, session.terminal_kind
        steps = [
            (STATE, ""), ("false", ""), ('echo "prev=$?"', "prev=1\n"), ("stty echo", ""),
            ("echo $((6*7))", "42\n"), ("stty -isig", ""), (STATE_CHECK, STATE_SEEN),
        ]
        for command, expected in steps:
            result = session.run(command.encode(), 10, None)
            assert result["output"].decode() == expected, (command, result)
        interrupted = session.run(b"sleep 30", 1, None)
        assert interrupted["exit_code"] == 130 and interrupted["interrupted"], interrupted
        assert session.run(STATE_CHECK.encode(), 10, None)["output"].decode() == STATE_SEEN
        # Raw mode (no ISIG): a typed Ctrl-C would be the editor's input; the signal comes
        # from a second shell started the same way, and the shell keeps its state.
        for ignore, code in (("", 130), ("signal.signal(signal.SIGINT, signal.SIG_IGN); ", 137)):
            editor = session.run(EDITOR.format(ignore=ignore).encode(), 1, None)
            assert editor["exit_code"] == code and "restarted" not in editor["note"], editor
            after = session.run(STATE_CHECK.encode(), 10, None)
            assert after["output"].decode() == STATE_SEEN, after
    finally:
        session.close()
