"""The bash tool through the supervisor's socket into a real bubblewrap sandbox."""

from __future__ import annotations

import asyncio

import pytest

from rollstream.sandboxes import ToolError

from .conftest import needs_bwrap

pytestmark = needs_bwrap


async def test_cwd_and_env_persist_across_calls(sb):
    await sb.bash("mkdir -p sub && cd sub && export GREETING=hello")
    result = await sb.bash('pwd; echo "$GREETING"')
    assert result.output == "/workspace/sub\nhello\n"
    assert result.exit_code == 0


async def test_exit_codes_are_reported(sb):
    assert (await sb.bash("false")).exit_code == 1
    assert (await sb.bash("(exit 42)")).exit_code == 42
    assert (await sb.bash("echo 'unclosed")).exit_code == 2  # a syntax error, not a hang


async def test_multiline_and_quoted_commands_run_as_one(sb):
    command = "cat <<'EOF'\nline 'one'\n\"two\" $HOME\nEOF\necho done"
    result = await sb.bash(command)
    assert result.output == "line 'one'\n\"two\" $HOME\ndone\n"


async def test_long_command_beyond_tty_line_limit(sb):
    result = await sb.bash("echo " + "x" * 20000 + " | wc -c")
    assert result.output.strip() == "20001"


async def test_timeout_interrupts_and_session_recovers(sb):
    await sb.bash("cd /tmp && export KEEP=1")
    result = await sb.bash("sleep 30", timeout_s=1)
    assert result.timed_out and result.interrupted
    assert result.exit_code == 130
    assert "timed out" in result.note
    after = await sb.bash('pwd; echo "$KEEP"')
    assert after.output == "/tmp\n1\n"


async def test_no_output_timeout_interrupts_a_silent_command(sb):
    result = await sb.bash("echo started; sleep 30", timeout_s=60, no_output_timeout_s=1)
    assert result.timed_out and result.interrupted
    assert "no output" in result.note
    assert result.output.startswith("started")
    assert (await sb.bash("echo ok")).output == "ok\n"


async def test_command_ignoring_ctrl_c_is_killed(sb):
    result = await sb.bash("bash -c \"trap '' INT; sleep 30\"", timeout_s=1)
    assert result.timed_out and result.interrupted
    assert (await sb.bash("echo alive")).output == "alive\n"


async def test_ten_megabytes_of_output_are_truncated_keeping_head_and_tail(sb):
    result = await sb.bash("seq 1 1500000", timeout_s=60)  # ~10.3 MB
    assert result.truncated
    assert result.total_bytes > 10_000_000
    assert len(result.output_bytes) < 70_000
    assert result.output.startswith("1\n2\n3\n")
    assert result.output.endswith("1499999\n1500000\n")
    assert "bytes of output elided" in result.output


async def test_non_utf8_output_survives(sb):
    result = await sb.bash(r"printf 'a\xff\xfeb\n'")
    assert result.output_bytes == b"a\xff\xfeb\n"
    assert result.output == "a\\xff\\xfeb\n"


async def test_shell_exit_starts_a_new_shell(sb):
    result = await sb.bash("exit 7")
    assert result.exit_code == 7
    again = await sb.bash("echo back")
    assert again.output == "back\n"
    assert "new one" in again.note


async def test_sessions_are_independent_and_run_side_by_side(sb):
    await sb.bash("cd /tmp", session="a")
    slow = asyncio.create_task(sb.bash("sleep 1; pwd", session="a"))
    await asyncio.sleep(0.2)
    fast = await sb.bash("pwd", session="b")
    assert fast.output == "/workspace\n"
    assert not slow.done()  # answered on the same connection while the other command ran
    assert (await sb.ping()) > 0 and not slow.done()
    assert (await slow).output == "/tmp\n"


async def test_second_command_in_a_busy_session_is_refused(sb):
    # The first command runs until the test lets it go, so the second surely finds it running.
    slow = asyncio.create_task(sb.bash("touch started; while [ ! -e go ]; do sleep 0.02; done", session="busy",
                                       timeout_s=120))
    for _ in range(600):
        if (await sb.bash("test -e started")).exit_code == 0:
            break
        await asyncio.sleep(0.05)
    with pytest.raises(ToolError, match="still running"):
        await sb.bash("echo no", session="busy")
    await sb.write_file("go", b"")
    assert (await slow).exit_code == 0
