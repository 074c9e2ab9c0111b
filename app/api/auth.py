"""The admin API's bearer check, one dependency for every /admin router."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from app.api.errors import Problem

# Declares the scheme (Swagger UI's "Authorize" button); we answer its errors.
bearer = HTTPBearer(auto_error=False, description="LLMGW_ADMIN_TOKEN")


def admin_guard(admin_token: str) -> Callable[[HTTPAuthorizationCredentials | None], None]:
    """A FastAPI dependency refusing requests without `admin_token`
    (LLMGW_ADMIN_TOKEN; compared in constant time, never logged or echoed)."""
    expected = admin_token.encode()

    def require_admin(
        creds: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        if creds is None or not creds.credentials:
            raise Problem(401, "Unauthorized", "send 'Authorization: Bearer <admin token>'")
        if not hmac.compare_digest(creds.credentials.encode(), expected):
            raise Problem(401, "Unauthorized", "wrong admin token")

    return require_admin
