"""The ``Authorization: Bearer`` parsing shared by client API keys and the admin token."""

from __future__ import annotations

import pytest

from pdserve.api_keys import refusal
from pdserve.auth import bearer_token, check_bearer


@pytest.mark.parametrize("value, token", [
    ("Bearer sekrit", "sekrit"),
    ("bearer sekrit", "sekrit"),       # the scheme is case-insensitive (RFC 7235 2.1)
    ("BEARER  sekrit ", "sekrit"),
    ("Basic c2Vrcml0", None),
    ("Bearer", None),
    ("Bearer   ", None),
    ("", None),
    (None, None),
])
def test_bearer_token(value, token):
    assert bearer_token(value) == token


def test_api_key_refusal_accepts_any_scheme_case_and_refuses_a_wrong_key():
    assert refusal([(b"authorization", b"bearer sekrit")], "sekrit") is None
    assert refusal([(b"authorization", b"Bearer sekrit")], "sekrit") is None
    wrong = refusal([(b"authorization", b"bearer other")], "sekrit")
    assert wrong["error"]["code"] == "invalid_api_key" and "Incorrect" in wrong["error"]["message"]
    missing = refusal([], "sekrit")
    assert missing["error"]["code"] == "invalid_api_key" and "provide" in missing["error"]["message"]


def test_admin_token_check():
    assert check_bearer("bearer t0k", "t0k", "PDSERVE_ADMIN_TOKEN") is None
    assert check_bearer(None, "t0k", "PDSERVE_ADMIN_TOKEN")[0] == 401
    assert check_bearer("Bearer nope", "t0k", "PDSERVE_ADMIN_TOKEN")[0] == 403
