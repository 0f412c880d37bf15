"""generation_first on the gen side: the waiting pull on the ctx server's lease endpoint.

One ``POST {ctx_url}/disagg/lease`` per request (wire format: :mod:`pdserve.kv_wait`), bounded by
``kv_transfer.ctx_wait_ms`` (the ctx server's queueing plus prefill; the pull that follows has its
own ``timeout_ms``). Every outcome but ``parked`` is a :class:`executor.phases.PhaseError` with a
clear message: the caller aborts the request, which frees this server's blocks; the ctx server has
freed its own (a ``timeout``) or never parked any.
"""

from __future__ import annotations

import httpx

from executor.phases import PhaseError
from pdserve.kv_wait import LEASE_PATH, LeaseWaitAnswer
from pdserve.protocol import DisaggregatedParams

HTTP_GRACE_S = 5.0     # the HTTP call may take this much longer than the wait (the ctx server answers timeouts)
CONNECT_TIMEOUT_S = 5.0

# OpenAI-style error types of the failures (the orchestrator reads them: a timeout is not retried).
WAIT_TIMEOUT = "ctx_wait_timeout"
CTX_FINISHED = "ctx_finished"
CTX_FAILED = "ctx_failed"


class CtxWaiter:
    """Asks ctx servers for the KV source of generation_first requests; owns one pooled HTTP client.

    Args:
        wait_ms: ``kv_transfer.ctx_wait_ms``, the longest one request waits.
    """

    def __init__(self, wait_ms: int) -> None:
        self.wait_ms = wait_ms
        timeout = httpx.Timeout(wait_ms / 1000.0 + HTTP_GRACE_S, connect=CONNECT_TIMEOUT_S)
        self._http = httpx.AsyncClient(timeout=timeout, trust_env=False,
                                       limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def wait(self, ctx_url: str, disagg_request_id: str, request_id: str | None = None) -> DisaggregatedParams:
        """The ctx answer's params for ``disagg_request_id`` once the ctx server parked its KV.

        Raises:
            PhaseError: 504 ``ctx_wait_timeout`` (nothing parked within ``wait_ms``), 409
                ``ctx_finished`` (the first token ended the request there), 502 ``ctx_failed``
                (the context phase failed, or the ctx server is unreachable or answered garbage).
        """
        body = {"disagg_request_id": disagg_request_id, "wait_ms": self.wait_ms}
        headers = {"X-Request-Id": request_id} if request_id else None
        try:
            r = await self._http.post(ctx_url + LEASE_PATH, json=body, headers=headers)
            r.raise_for_status()
            answer = LeaseWaitAnswer.model_validate_json(r.content)
        except httpx.TimeoutException:
            raise PhaseError(f"the ctx server {ctx_url} did not answer the wait for {disagg_request_id} within "
                             f"{self.wait_ms} ms (kv_transfer.ctx_wait_ms)", 504, WAIT_TIMEOUT) from None
        except (httpx.HTTPError, ValueError) as err:
            raise PhaseError(f"waiting on the ctx server {ctx_url} for {disagg_request_id} failed: "
                             f"{type(err).__name__}: {err}", 502, CTX_FAILED) from None
        return _params_of(answer, ctx_url, disagg_request_id, self.wait_ms)

    async def close(self) -> None:
        await self._http.aclose()


def _params_of(answer: LeaseWaitAnswer, ctx_url: str, disagg_request_id: str, wait_ms: int) -> DisaggregatedParams:
    if answer.state == "parked" and answer.disaggregated_params is not None:
        return answer.disaggregated_params
    if answer.state == "timeout":
        raise PhaseError(f"the ctx server {ctx_url} parked no KV for {disagg_request_id} within {wait_ms} ms "
                         "(kv_transfer.ctx_wait_ms); both servers freed the request", 504, WAIT_TIMEOUT)
    if answer.state == "finished":
        raise PhaseError(f"the ctx server {ctx_url} finished {disagg_request_id} at its first token: "
                         "nothing to pull", 409, CTX_FINISHED)
    raise PhaseError(f"the context phase of {disagg_request_id} on {ctx_url} failed: {answer.message or answer.state}",
                     502, CTX_FAILED)
