"""generation_first: the gen server's waiting pull on the ctx server's lease endpoint (wire format).

With ``orchestrator.schedule_style: generation_first`` the orchestrator sends the gen request at
the same time as the ctx request; the gen request's ``disaggregated_params`` name only the
``disagg_request_id`` and the ctx server (``ctx_url``). The gen server admits the request
(allocates its blocks) and asks the ctx server, once, where the KV is:

    POST {ctx_url}/disagg/lease   {"disagg_request_id": "...", "wait_ms": 60000}

The ctx server answers when the context phase of that ``disagg_request_id`` has an outcome, or
when ``wait_ms`` has passed (200 in every case; ``state`` says which):

- ``parked``: the KV is parked under a lease; ``disaggregated_params`` are exactly what the ctx
  answer to the orchestrator carries (``ctx_request_id``, ``first_gen_tokens``, ``kv_endpoint``...),
  and the gen server pulls as in ``context_first``;
- ``finished``: the first token ended the request on the ctx server: nothing to pull (the
  orchestrator answers from the ctx answer);
- ``failed``: the context phase failed or was aborted (``message`` says why);
- ``timeout``: nothing parked within ``wait_ms``; the ctx server has aborted the request (or
  released its lease), so both sides' blocks are free.

A wait may arrive before the ctx request does (both leave the orchestrator at once): the ctx
server holds it until the outcome. An outcome that comes first is kept until its lease ends, so a
later wait is answered at once. Waiting is bounded by the gen server's ``kv_transfer.ctx_wait_ms``
(it covers the ctx server's queueing plus prefill; the pull that follows has its own
``kv_transfer.timeout_ms``). Imports only pydantic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.protocol import DisaggregatedParams

LEASE_PATH = "/disagg/lease"
MAX_WAIT_MS = 600_000  # a ctx server holds one wait at most this long, whatever the caller asks

LeaseState = Literal["parked", "finished", "failed", "timeout"]


class LeaseWaitBody(BaseModel):
    """``POST /disagg/lease``: wait (at most ``wait_ms`` ms) for the KV of ``disagg_request_id``."""

    model_config = ConfigDict(extra="forbid")
    disagg_request_id: str = Field(..., min_length=1, max_length=256)
    wait_ms: int = Field(..., ge=1, le=MAX_WAIT_MS)


class LeaseWaitAnswer(BaseModel):
    """The outcome of a wait; ``disaggregated_params`` only when ``state`` is ``parked``."""

    state: LeaseState
    disaggregated_params: DisaggregatedParams | None = None
    message: str = ""
