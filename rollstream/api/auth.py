"""Bearer-token auth for the HTTP API: the token comes from ROLLSTREAM_API_TOKEN, or a file
named by ROLLSTREAM_API_TOKEN_FILE, or is generated into the data folder on first start;
requests are compared in constant time. The dependency is FastAPI's HTTP bearer scheme, so
the OpenAPI spec declares it on every guarded route."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

_SCHEME = HTTPBearer(auto_error=False, scheme_name="bearer",
                     description="The API token: ROLLSTREAM_API_TOKEN, or <data_dir>/api-token")


def load_token(data_dir: Path) -> str:
    if token := os.environ.get("ROLLSTREAM_API_TOKEN"):
        return token.strip()
    if path := os.environ.get("ROLLSTREAM_API_TOKEN_FILE"):
        return Path(path).read_text().strip()
    path = data_dir / "api-token"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    path.write_text(token)
    path.chmod(0o600)
    return token


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
