"""Sandbox backends: each turns a SandboxSpec into a LaunchPlan the supervisor executes.

base.py is the interface, common.py what the backends share, factory.py picks one."""

from .base import LaunchPlan, SandboxBackend, SandboxLayout
from .factory import get_backend, select_backend

__all__ = ["LaunchPlan", "SandboxBackend", "SandboxLayout", "get_backend", "select_backend"]
