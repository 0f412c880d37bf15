"""A bound on the client requests one orchestrator has open (429 + ``Retry-After`` past it).

Requests are counted from the moment their headers arrive until their last byte is sent (a
stream counts for its whole length). Past ``limit`` a request is refused at once, before its
body is read or any server is asked: under overload a fast, honest 429 keeps the latency of the
admitted requests bounded, where an unbounded queue would make every request late.
"""

from __future__ import annotations

from .errors import OrchestratorError


class Admission:
    """``limit`` open requests at most (0 = no bound); ``retry_after_s`` goes in the 429's header."""

    def __init__(self, limit: int, retry_after_s: int) -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def enter(self) -> None:
        """Count one request in. Raises OrchestratorError 429 (type ``rate_limit_error``) when full."""
        if self.limit and self.in_flight >= self.limit:
            raise OrchestratorError(
                429, f"the orchestrator is at its limit of {self.limit} open requests "
                     f"(orchestrator.max_inflight_requests); retry after {self.retry_after_s} s",
                kind="overloaded", headers=(("Retry-After", str(self.retry_after_s)),))
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
