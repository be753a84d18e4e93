"""The factory: the backend a SandboxSpec names, or for 'auto' the first isolating one
that works on this machine."""

from __future__ import annotations

from rollstream.sandbox_spec import SandboxSpec

from ..errors import BackendUnavailable
from .base import SandboxBackend
from .bwrap import BwrapBackend
from .docker import DockerBackend
from .local import LocalBackend
from .singularity import SingularityBackend

_BACKENDS: dict[str, type[SandboxBackend]] = {
    "bwrap": BwrapBackend,
    "singularity": SingularityBackend,
    "docker": DockerBackend,
    "local": LocalBackend,
}


def get_backend(name: str) -> SandboxBackend:
    """The backend called `name` (bwrap, singularity, docker or local), usable or not."""
    if name not in _BACKENDS:
        raise BackendUnavailable(f"unknown sandbox backend {name!r}; use one of auto, {', '.join(_BACKENDS)}")
    return _BACKENDS[name]()


def select_backend(spec: SandboxSpec) -> SandboxBackend:
    """The backend a spec asks for, or for 'auto' the first isolating one that works here."""
    if spec.backend != "auto":
        backend = get_backend(spec.backend)
        if not backend.available():
            raise BackendUnavailable(
                f"sandbox backend {spec.backend!r} is not usable on this machine; install it "
                f"({_INSTALL_HINTS[spec.backend]}) or use backend='auto'"
            )
        return backend
    for name in ("bwrap", "singularity", "docker"):
        backend = get_backend(name)
        if backend.available():
            return backend
    raise BackendUnavailable(
        "no sandbox backend works on this machine; install bubblewrap (apt install bubblewrap), "
        "Apptainer/Singularity or Docker, or for development only use backend='local' with "
        "allow_unisolated=True"
    )


_INSTALL_HINTS = {
    "bwrap": "apt install bubblewrap",
    "singularity": "install Apptainer or SingularityCE so that 'apptainer' or 'singularity' is on PATH",
    "docker": "install Docker and start the engine; 'docker info' must succeed",
    "local": "always available",
}
