"""The admin token: who may scale pools, drain servers and register servers.

The secret never sits in a topology file: the file names an environment variable
(``orchestrator.admin_token_env``, default ``PDSERVE_ADMIN_TOKEN``) and every process reads it
from its own environment. Clients send ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import os


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` header value, or ``None`` when the
    value is missing, names another scheme or carries no token. The scheme name is matched
    case-insensitively (RFC 7235 section 2.1: ``bearer`` and ``BEARER`` are ``Bearer``)."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def admin_token(env_name: str) -> str | None:
    """The configured token (``None`` when the variable is unset or empty)."""
    return os.environ.get(env_name) or None


def auth_headers(env_name: str) -> dict[str, str]:
    token = admin_token(env_name)
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_bearer(authorization: str | None, expected: str | None, env_name: str,
                 open_when_unset: bool = False) -> tuple[int, str] | None:
    """``None`` when allowed, else ``(status, message)``: 401 without a token, 403 with a wrong one.

    With no token configured the endpoint is open when ``open_when_unset``, else refused (403).
    """
    if expected is None:
        if open_when_unset:
            return None
        return 403, f"the admin API is disabled: set ${env_name} for this process (and send it as a Bearer token)"
    token = bearer_token(authorization)
    if token is None:
        return 401, "missing admin token: send 'Authorization: Bearer <token>'"
    if not hmac.compare_digest(token.encode(), expected.encode()):
        return 403, "wrong admin token"
    return None
