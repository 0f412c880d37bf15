"""The admin token: who may scale pools, drain servers and register servers.

The secret never sits in a topology file: the file names an environment variable
(``orchestrator.admin_token_env``, default ``PDSERVE_ADMIN_TOKEN``) and every process reads it
from its own environment. Clients send ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import os


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
    if not authorization or not authorization.startswith("Bearer "):
        return 401, "missing admin token: send 'Authorization: Bearer <token>'"
    if not hmac.compare_digest(authorization.removeprefix("Bearer ").strip().encode(), expected.encode()):
        return 403, "wrong admin token"
    return None
