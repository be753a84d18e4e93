"""Bearer-token auth for the HTTP API: the token comes from ROLLSTREAM_API_TOKEN, or a file
named by ROLLSTREAM_API_TOKEN_FILE, or is generated into the data folder on first start
(a 0600 file from its creation, published whole; one found there is used only if it is ours
alone); requests are compared in constant time. The dependency is FastAPI's HTTP bearer scheme, so
the OpenAPI spec declares it on every guarded route."""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from rollstream.config import env_setting

_SCHEME = HTTPBearer(auto_error=False, scheme_name="bearer",
                     description="The API token: ROLLSTREAM_API_TOKEN, or <data_dir>/api-token")


class UnsafeTokenFile(RuntimeError):
    """The API token file in the data folder could be read or chosen by another user."""


def load_token(data_dir: Path) -> str:
    if token := env_setting("API_TOKEN"):
        return token.strip()
    if named := env_setting("API_TOKEN_FILE"):
        return Path(named).read_text().strip()
    path = data_dir / "api-token"
    data_dir.mkdir(parents=True, exist_ok=True)
    token = _read_own_token(path)
    if token is not None:
        return token
    token = secrets.token_urlsafe(32)
    # Written whole into a file that is 0600 from its creation (never readable by others, not
    # even for a moment), then published under its name by link(2), which never replaces what
    # is there: an API starting beside us, or a name planted by someone else, wins, and is read.
    draft = data_dir / f".api-token.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, token.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(draft, path)
    except FileExistsError:
        token = _read_own_token(path) or ""
    finally:
        os.unlink(draft)
    return token


def _read_own_token(path: Path) -> str | None:
    """The token in `path`, None if there is no such file; raises UnsafeTokenFile for one that
    is a symlink, not ours, or open to other users (who could know or have chosen its token)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a symlink
        raise UnsafeTokenFile(f"{path} is not a plain file ({error.strerror}); remove it, and the API makes a "
                              "new token there on its next start (or set ROLLSTREAM_API_TOKEN)") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            raise UnsafeTokenFile(
                f"{path} (owner uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}) may be known to other "
                f"users: the API uses only a file of its own uid ({os.geteuid()}) with mode 600; remove it (a "
                "new token is made on the next start) or set ROLLSTREAM_API_TOKEN"
            )
        return handle.read(4096).decode().strip()


class BearerAuth:
    """FastAPI dependency that admits only ``Authorization: Bearer <token>``."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the API token is empty; set ROLLSTREAM_API_TOKEN")
        self._token = token.encode()

    async def __call__(self, credentials: HTTPAuthorizationCredentials | None = Depends(_SCHEME)) -> None:
        given = credentials.credentials if credentials is not None else ""
        if credentials is None or not hmac.compare_digest(given.strip().encode(), self._token):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED,
                                detail="missing or wrong bearer token; send 'Authorization: Bearer <token>' "
                                       "(the token is in ROLLSTREAM_API_TOKEN or <data_dir>/api-token)",
                                headers={"WWW-Authenticate": "Bearer"})
