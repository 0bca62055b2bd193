"""API keys: Bearer or X-Api-Key, compared in constant time, never logged."""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from muser.errors import MuserError
from muser.server.errors import ApiError


def read_key_file(path: str) -> list[str]:
    """One key per line; blank lines and '#' comments are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise MuserError(f"cannot read --api-key-file: {exc.strerror}: {path}") from None
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def _matches(key: str | None, keys: tuple[str, ...]) -> bool:
    """Constant time in the key's content: every configured key is compared."""
    given = (key or "").encode()
    hits = [hmac.compare_digest(given, k.encode()) for k in keys]
    return key is not None and any(hits)


@dataclass(frozen=True)
class Keys:
    api: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()

    def check_user(self, request: Request) -> None:
        """Any API key or admin key passes; with no keys configured everything passes."""
        if not self.api and not self.admin:
            return
        if not _matches(presented_key(request), self.api + self.admin):
            raise _unauthorized()

    def check_admin(self, request: Request) -> None:
        """Only the admin key passes; with no admin key they are open only on a keyless server."""
        if not self.admin:
            if self.api:
                raise ApiError(403, "admin routes are disabled: start the server with --admin-key",
                               "admin_disabled")
            return
        if not _matches(presented_key(request), self.admin):
            raise _unauthorized()


def _unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key. Pass it as 'Authorization: Bearer KEY' "
                    "or 'X-Api-Key: KEY'.", "invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"})
