"""Optional client API keys on the OpenAI routes (off by default).

A process reads its key from the environment variable its settings name (the orchestrator's
``orchestrator.api_key_env``, a server's ``pools.<role>.api_key_env``): the secret never sits in a
topology file. Clients send ``Authorization: Bearer <key>`` (what the official ``openai`` client
sends as its ``api_key``). A missing or wrong key on a protected route is answered 401 with the body
OpenAI's API answers (``type: invalid_request_error``, ``code: invalid_api_key``).

Protected: every ``/v1/...`` route, ``/tokenize`` and ``/detokenize``. Open: ``/health``,
``/metrics``, ``/version``, ``/server_info``, ``/tokenizer``, the cluster routes and the admin
routes (those carry their own admin token, :mod:`pdserve.auth`).
"""

from __future__ import annotations

import hmac
import json
import os

from .auth import bearer_token
from .protocol import error_body

PROTECTED_PREFIXES = ("/v1/",)
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})


class MissingApiKey(ValueError):
    """The settings name an environment variable for the API key, and it is unset or empty."""


def load_api_key(env_name: str | None) -> str | None:
    """The key the variable ``env_name`` holds; ``None`` when ``env_name`` is None (keys off).

    Raises:
        MissingApiKey: ``env_name`` is set but the variable is unset or empty (a server must not
            fall back to open routes because a secret was not exported).
    """
    if env_name is None:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise MissingApiKey(f"api_key_env names ${env_name}, which is unset or empty: export the key "
                            "(or remove api_key_env to serve without keys)")
    return key


def is_protected(path: str) -> bool:
    """Whether ``path`` (an ASGI scope path) needs the API key."""
    return path.startswith(PROTECTED_PREFIXES) or path in PROTECTED_PATHS


def bearer_headers(key: str | None) -> tuple[tuple[str, str], ...]:
    """``Authorization: Bearer <key>`` as header pairs (none without a key)."""
    return (("Authorization", f"Bearer {key}"),) if key else ()


def refusal(headers: list[tuple[bytes, bytes]], expected: str) -> dict | None:
    """``None`` when ``headers`` (ASGI, lower-case names) carry ``Bearer <expected>``, else the
    401 error body (compared in constant time)."""
    given = None
    for name, value in headers:
        if name == b"authorization":
            given = value.decode("latin-1")
            break
    token = bearer_token(given)
    if token is None:
        return error_body("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.",
                          "invalid_request_error", "invalid_api_key")
    if not hmac.compare_digest(token.encode(), expected.encode()):
        return error_body("Incorrect API key provided.", "invalid_request_error",
                          "invalid_api_key")
    return None


async def send_refusal(send, body: dict) -> None:
    """Answer an ASGI request with ``body`` as a 401 JSON response."""
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 401,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            (b"www-authenticate", b"Bearer")]})
    await send({"type": "http.response.body", "body": raw})


class ApiKeyGuard:
    """Pure ASGI middleware: a protected route without the right key is answered 401; with
    ``key`` None every request passes."""

    def __init__(self, app, key: str | None) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if self.key is not None and scope["type"] == "http" and is_protected(scope["path"]):
            body = refusal(scope["headers"], self.key)
            if body is not None:
                return await send_refusal(send, body)
        return await self.app(scope, receive, send)
