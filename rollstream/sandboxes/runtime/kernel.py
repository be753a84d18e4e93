"""The IPython tool: one Jupyter kernel per sandbox, started inside it on first use.

The kernel runs in the sandbox (same rootfs, workdir and limits as bash) and talks ipc
through a host folder bound into the sandbox; jupyter_client is imported only here and
only when the kernel is first needed, so sandboxes that never use Python start fast.
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
import subprocess
import threading
import time

from_package = bool(__package__)
if from_package:
    from .bash_session import OutputCollector, SessionBusy, kill_session_processes
else:  # run as a script by the supervisor (python -S supervisor.py)
    from bash_session import OutputCollector, SessionBusy, kill_session_processes

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_POLL_S = 0.25


class KernelStartError(RuntimeError):
    """The kernel process did not come up inside the sandbox."""


class Kernel:
    """A kernel process inside the sandbox plus a blocking client on the host side."""

    def __init__(
        self,
        exec_prefix: list[str],
        kernel_argv: list[str],
        env: dict[str, str],
        cwd: str | None,
        rlimits: dict[str, int],
        host_dir: str,
        inner_dir: str,
        output_bytes: int,
        log_path: str,
        start_timeout_s: float = 60.0,
        interrupt_grace_s: float = 3.0,
    ) -> None:
        self.exec_prefix = exec_prefix
        self.kernel_argv = kernel_argv
        self.env = env
        self.cwd = cwd
        self.rlimits = rlimits
        self.host_dir = host_dir
        self.inner_dir = inner_dir
        self.output_bytes = output_bytes
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        self.interrupt_grace_s = interrupt_grace_s
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None
        self.client = None

    # -- lifecycle -------------------------------------------------------------------
    def _preexec(self) -> None:
        for name, value in self.rlimits.items():
            resource.setrlimit(getattr(resource, name), (value, value))

    def start(self) -> None:
        from jupyter_client import BlockingKernelClient  # heavy: only on first use

        os.makedirs(self.host_dir, exist_ok=True)
        info = {
            "transport": "ipc",
            "shell_port": 1,
            "iopub_port": 2,
            "stdin_port": 3,
            "control_port": 4,
            "hb_port": 5,
            "key": secrets.token_hex(16),
            "signature_scheme": "hmac-sha256",
            "kernel_name": "python3",
        }
        # Host and sandbox see the same folder under different paths: one file for each.
        inner_info = dict(info, ip=os.path.join(self.inner_dir, "k"))
        with open(os.path.join(self.host_dir, "kernel.json"), "w") as handle:
            json.dump(inner_info, handle)
        argv = [a.replace("{connection_file}", os.path.join(self.inner_dir, "kernel.json"))
                for a in self.kernel_argv]
        log = open(self.log_path, "ab")
        try:
            self.process = subprocess.Popen(
                self.exec_prefix + argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=self._preexec if self.rlimits else None,
            )
        finally:
            log.close()
        client = BlockingKernelClient()
        client.load_connection_info(dict(info, ip=os.path.join(self.host_dir, "k")))
        client.start_channels()
        self.client = client
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.process.poll() is not None:
                self.close()
                raise KernelStartError(
                    f"the IPython kernel exited with status {self.process.returncode} while "
                    f"starting; is ipykernel installed in the sandbox image? see {self.log_path}"
                )
            try:
                client.wait_for_ready(timeout=min(1.0, max(deadline - time.monotonic(), 0.01)))
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    self.close()
                    raise KernelStartError(
                        f"the IPython kernel did not answer within {self.start_timeout_s:g} s; "
                        f"see {self.log_path}"
                    ) from None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.stop_channels()
        process, self.process = self.process, None
        if process is not None:
            kill_session_processes(process.pid)
            try:
                process.kill()
            except ProcessLookupError:
                pass
            process.wait()

    # -- the tool --------------------------------------------------------------------
    def execute(self, code: str, timeout_s: float) -> dict:
        if not self.lock.acquire(blocking=False):
            raise SessionBusy("the IPython kernel is still running a cell; wait for it to finish")
        try:
            return self._execute(code, timeout_s)
        finally:
            self.lock.release()

    def _execute(self, code: str, timeout_s: float) -> dict:
        started = time.monotonic()
        notes: list[str] = []
        if not self.alive:
            if self.process is not None:
                notes.append("the kernel had died and was restarted; its state is lost")
            self.close()
            self.start()
        assert self.client is not None
        msg_id = self.client.execute(code, store_history=True, allow_stdin=False)
        out = {"stdout": OutputCollector(self.output_bytes), "stderr": OutputCollector(self.output_bytes)}
        result: dict = {"result": None, "error": None, "images_png_b64": [], "execution_count": None}
        finished = self._collect(msg_id, started + timeout_s, out, result)
        timed_out = not finished
        interrupted = False
        if timed_out:
            interrupted = True
            notes.append(f"cell timed out after {timeout_s:g} s and was interrupted")
            self._send_interrupt()
            if not self._collect(msg_id, time.monotonic() + self.interrupt_grace_s, out, result):
                self.close()
                notes.append("the kernel ignored the interrupt and was restarted; its state is lost")
        elif not self.alive:
            notes.append("the kernel died while running the cell; the next cell starts a new one")
        return {
            "stdout": out["stdout"].render().decode("utf-8", "replace"),
            "stderr": out["stderr"].render().decode("utf-8", "replace"),
            **result,
            "timed_out": timed_out,
            "interrupted": interrupted,
            "truncated": out["stdout"].truncated or out["stderr"].truncated,
            "duration_ms": (time.monotonic() - started) * 1000.0,
            "note": "; ".join(notes),
        }

    def _collect(self, msg_id: str, deadline: float, out: dict, result: dict) -> bool:
        """Gather iopub messages of `msg_id` until the kernel goes idle; False on timeout."""
        import queue

        assert self.client is not None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                message = self.client.get_iopub_msg(timeout=min(remaining, _POLL_S))
            except queue.Empty:
                if not self.alive:
                    result["error"] = result["error"] or "KernelDied: the kernel process exited"
                    return True
                continue
            if message.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = message["msg_type"]
            content = message["content"]
            if kind == "stream":
                out[content.get("name", "stdout") if content.get("name") in out else "stdout"].add(
                    content.get("text", "").encode("utf-8", "replace")
                )
            elif kind in ("execute_result", "display_data"):
                data = content.get("data", {})
                if "image/png" in data:
                    result["images_png_b64"].append(data["image/png"].replace("\n", ""))
                if kind == "execute_result":
                    result["result"] = data.get("text/plain")
                    result["execution_count"] = content.get("execution_count")
                elif "text/plain" in data and "image/png" not in data:
                    out["stdout"].add((data["text/plain"] + "\n").encode("utf-8", "replace"))
            elif kind == "error":
                traceback = "\n".join(content.get("traceback", []))
                result["error"] = _ANSI.sub("", traceback) or f"{content.get('ename')}: {content.get('evalue')}"
            elif kind == "status" and content.get("execution_state") == "idle":
                self._drain_shell(msg_id)
                return True

    def _drain_shell(self, msg_id: str) -> None:
        import queue

        assert self.client is not None
        try:
            while True:
                reply = self.client.get_shell_msg(timeout=0.5)
                if reply.get("parent_header", {}).get("msg_id") == msg_id:
                    return
        except queue.Empty:
            return

    def _send_interrupt(self) -> None:
        assert self.client is not None
        # ipykernel answers interrupt_request on the control channel by signalling itself;
        # this works through any container runtime, unlike a host-side signal.
        message = self.client.session.msg("interrupt_request", content={})
        self.client.control_channel.send(message)
