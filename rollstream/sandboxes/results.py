"""Typed results of the sandbox tools, as the client returns them to workers."""

from __future__ import annotations

from pydantic import BaseModel, Field


class BashResult(BaseModel):
    output: str = Field(description="combined stdout/stderr, UTF-8 with undecodable bytes as \\xNN")
    exit_code: int | None = Field(description="None when the command was killed or the shell restarted")
    timed_out: bool = False
    interrupted: bool = False
    truncated: bool = False
    duration_ms: float = 0.0
    total_bytes: int = 0
    note: str = Field("", description="what the supervisor did: timeouts, interrupts, shell restarts")
    output_bytes: bytes = Field(b"", repr=False, description="the output exactly as the pty gave it")


class IPythonResult(BaseModel):
    stdout: str = ""
    stderr: str = ""
    result: str | None = Field(None, description="text/plain of the cell's value")
    error: str | None = Field(None, description="traceback text when the cell raised")
    images_png_b64: list[str] = Field(default_factory=list)
    execution_count: int | None = None
    timed_out: bool = False
    interrupted: bool = False
    truncated: bool = False
    duration_ms: float = 0.0
    note: str = ""


class EditResult(BaseModel):
    output: str


class ToolOutput(BaseModel):
    """What the agent loop appends as the tool observation; never an exception."""

    text: str
    ok: bool = True
    error: str | None = None
    images_png_b64: list[str] = Field(default_factory=list)
    # The sandbox itself is gone (supervisor crashed or reaped): not the agent's doing, so the
    # episode ends as an infrastructure failure and the job is retried in a fresh sandbox.
    sandbox_lost: bool = False
