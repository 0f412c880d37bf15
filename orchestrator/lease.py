"""The KV lease a ctx server holds for one request, and the failure of pulling it.

Its own module so that :mod:`orchestrator.disagg`, :mod:`orchestrator.migration` and
:mod:`orchestrator.gen_first` share these names without importing each other at call time.
"""

from __future__ import annotations

from dataclasses import dataclass

KV_SOURCE_FAILED = "kv_transfer_error"  # a gen server's error type when pulling from the ctx server failed


class KVSourceFailed(Exception):
    """The gen server could not pull the parked KV: the ctx side is at fault, not the gen pool."""


@dataclass(frozen=True)
class Lease:
    """The KV blocks a ctx server parked for one request (``ctx_request_id`` on ``ctx_url``)."""

    ctx_url: str
    ctx_request_id: str
