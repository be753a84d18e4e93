"""Sandbox backends: each turns a SandboxSpec into a LaunchPlan the supervisor executes."""

from .base import LaunchPlan, SandboxBackend, SandboxLayout, get_backend, select_backend

__all__ = ["LaunchPlan", "SandboxBackend", "SandboxLayout", "get_backend", "select_backend"]
