"""Phase handlers: how one request type runs on a server.

The HTTP layer turns an OpenAI body into an :class:`engine.request.EngineRequest`, picks the
handler for its ``request_type`` and streams the handler's :class:`RequestOutput` items back.
``context_and_generation`` (colocated) is built in; the ctx role adds ``context_only``
(``ctx_worker``) and the gen role ``generation_only`` (``gen_worker``). The executor never imports
those packages: they hand their handlers in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.request import EngineRequest, KVPull, RequestOutput
from executor.engine_client import EngineClient
from executor.kv_role import KVMoved
from pdserve.protocol import DisaggregatedParams


@dataclass
class PhaseAnswer:
    """What a handler adds to the response besides tokens: the ctx answer's params, or ``moved``
    (the params of a request moved off this draining server; its stream ends with a moved event).
    ``moved_choices``: an n > 1 request moved choice by choice, one lease's params per moved choice
    (``choice_index`` set), in the order they were parked."""

    disaggregated_params: DisaggregatedParams | None = None
    moved: DisaggregatedParams | None = None
    moved_choices: list[DisaggregatedParams] = field(default_factory=list)

    def add_moved(self, item: KVMoved) -> None:
        """Record a move's params: a moved choice's (``choice_index`` set) or an n = 1 request's."""
        if item.params.choice_index is not None:
            self.moved_choices.append(item.params)
        else:
            self.moved = item.params


class PhaseError(RuntimeError):
    """A phase failed for a reason the client should see; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 502, kind: str = "phase_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind

    def __reduce__(self):  # keep status and kind when the error crosses a process boundary
        return (PhaseError, (str(self), self.status, self.kind))


class PhaseHandler(Protocol):
    """Runs one request type. Yields outputs until one is ``finished``.

    Raises :class:`PhaseError` (and whatever :meth:`EngineClient.generate` raises).
    """

    def __call__(self, request: EngineRequest, params: DisaggregatedParams | None,
                 answer: PhaseAnswer) -> AsyncIterator[RequestOutput]: ...


class ColocatedPhase:
    """``context_and_generation``: prefill and decode on this server."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client

    async def __call__(self, request: EngineRequest, params: DisaggregatedParams | None,
                       answer: PhaseAnswer) -> AsyncIterator[RequestOutput]:
        async for item in self.client.generate(request):
            if isinstance(item, KVPull):  # cannot happen for this phase; refuse loudly
                raise PhaseError("engine asked for a KV pull on a colocated request", 500, "internal")
            if isinstance(item, KVMoved):  # drained with move_kv: the final output (reason "moved") follows
                answer.add_moved(item)
                continue
            yield item
