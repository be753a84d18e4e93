"""SandboxClient: the worker side of a sandbox, an asyncio client of its supervisor's socket.

Requests carry ids, so one connection can run calls in several bash sessions at once;
`call_tool` is the entry point for model-produced tool calls (see tools.py).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, cast

from .errors import SandboxGone, ToolError
from .results import BashResult, EditResult, IPythonResult, ToolOutput
from .runtime import protocol
from .runtime.unix_path import open_unix_connection
from .tools import call_tool

_LIVE_READERS: set[asyncio.Task] = set()  # every connected client's reader, until its connection ends


class SandboxClient:
    """`async with SandboxClient(handle.socket_path) as sb: await sb.bash("ls")`."""

    def __init__(self, socket_path: str, connect_timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.connect_timeout_s = connect_timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[protocol.Reply]] = {}
        self._ids = itertools.count(1)
        self._read_task: asyncio.Task | None = None
        self._closed_error: Exception | None = None

    async def connect(self) -> SandboxClient:
        try:
            self._reader, self._writer = await asyncio.wait_for(
                open_unix_connection(self.socket_path, limit=protocol.MAX_FRAME_BYTES),
                self.connect_timeout_s,
            )
        except (TimeoutError, FileNotFoundError, ConnectionRefusedError) as error:
            raise SandboxGone(
                f"no sandbox supervisor answers at {self.socket_path} ({type(error).__name__}); it was "
                "destroyed, reaped for idleness, or lives on another node"
            ) from None
        self._read_task = asyncio.get_running_loop().create_task(self._read_replies())
        # asyncio's stream protocol holds the reader only weakly and the loop its tasks weakly:
        # without this a client whose holders form a cycle (its pending future -> the awaiting
        # task -> its frame -> the client) is collected mid-request, failing it as SandboxGone.
        _LIVE_READERS.add(self._read_task)
        self._read_task.add_done_callback(_LIVE_READERS.discard)
        return self

    async def __aenter__(self) -> SandboxClient:
        return await self.connect()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass
        if self._read_task is not None:
            self._read_task.cancel()
            try:
                await self._read_task
            except (asyncio.CancelledError, Exception):
                pass

    async def _read_replies(self) -> None:
        assert self._reader is not None
        try:
            while True:
                header = await self._reader.readexactly(protocol.HEADER.size)
                body = await self._reader.readexactly(protocol.frame_length(header))
                reply = cast(protocol.Reply, protocol.unpack(body))
                future = self._pending.pop(reply.get("id") or 0, None)
                if future is not None and not future.done():
                    future.set_result(reply)
        except (asyncio.IncompleteReadError, ConnectionError, protocol.ProtocolError) as error:
            self._closed_error = error
        finally:
            gone = SandboxGone(f"the sandbox supervisor at {self.socket_path} closed the connection")
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(gone)
            self._pending.clear()

    async def request(self, op: protocol.Op, **args: Any) -> Any:
        """Send one request and wait for its result (the op's type in protocol.py); raises
        ToolError or SandboxGone."""
        if self._writer is None:
            await self.connect()
        assert self._writer is not None
        if self._read_task is not None and self._read_task.done():
            raise SandboxGone(f"the sandbox supervisor at {self.socket_path} closed the connection")
        request_id = next(self._ids)
        future: asyncio.Future[protocol.Reply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self._writer.write(protocol.pack(protocol.request(request_id, op, args)))
            await self._writer.drain()
        except (ConnectionError, OSError) as error:
            self._pending.pop(request_id, None)
            raise SandboxGone(f"cannot reach the sandbox supervisor at {self.socket_path}: {error}") from None
        reply = await future
        if not reply.get("ok"):
            raise ToolError(reply.get("kind", "Error"), reply.get("error", "unknown error"))
        return reply["result"]

    # -- tools ---------------------------------------------------------------------------
    async def ping(self) -> int:
        result: protocol.PingResult = await self.request("ping")
        return result["pid"]

    async def bash(
        self,
        command: str | bytes,
        timeout_s: float | None = None,
        no_output_timeout_s: float | None = None,
        session: str = "main",
    ) -> BashResult:
        """Run `command` in a persistent bash session; None timeouts use the sandbox defaults, 0 disables."""
        result: protocol.BashResult = await self.request(
            "bash", command=command, timeout_s=timeout_s, no_output_timeout_s=no_output_timeout_s, session=session
        )
        raw = result["output"]
        return BashResult(
            output=raw.decode("utf-8", "backslashreplace"), output_bytes=raw, exit_code=result["exit_code"],
            timed_out=result["timed_out"], interrupted=result["interrupted"], truncated=result["truncated"],
            duration_ms=result["duration_ms"], total_bytes=result["total_bytes"], note=result["note"],
        )

    async def ipython(self, code: str, timeout_s: float | None = None) -> IPythonResult:
        """Run a cell in the sandbox's IPython kernel (started on first use)."""
        result: protocol.IPythonResult = await self.request("ipython", code=code, timeout_s=timeout_s)
        return IPythonResult(**result)

    async def edit(
        self,
        command: str,
        path: str,
        file_text: str | None = None,
        old_str: str | None = None,
        new_str: str | None = None,
        insert_line: int | None = None,
        view_range: list[int] | None = None,
    ) -> EditResult:
        """view / create / str_replace / insert / undo_edit a file under the workdir."""
        result: protocol.EditResult = await self.request(
            "edit",
            command=command,
            path=path,
            file_text=file_text,
            old_str=old_str,
            new_str=new_str,
            insert_line=insert_line,
            view_range=view_range,
        )
        return EditResult(output=result["output"])

    async def write_file(self, path: str, data: bytes | str, mode: int | None = None) -> None:
        """Write a file under the workdir or /tmp (paths as seen inside the sandbox)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        await self.request("write_file", path=path, data=data, mode=mode)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        result: protocol.ReadFileResult = await self.request("read_file", path=path, max_bytes=max_bytes)
        return result["data"]

    async def close_session(self, session: str) -> bool:
        result: protocol.CloseSessionResult = await self.request("close_session", session=session)
        return result["closed"]

    async def info(self) -> protocol.InfoResult:
        return await self.request("info")

    async def call_tool(self, name: str, arguments: dict | str) -> ToolOutput:
        """Run a model-produced tool call; bad input comes back as ToolOutput(ok=False)."""
        return await call_tool(self, name, arguments)


