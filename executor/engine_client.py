"""The interface between a server's HTTP layer and its engine: submit, abort, stream of responses.

The HTTP code (``executor.http_server``) and the phase handlers (``ctx_worker``, ``gen_worker``)
talk to an engine only through :class:`EngineClient`. Today's implementation runs the engine loop
in a thread of the server process (``executor.inproc_executor``); the multi-process lattice (MPI
ranks behind IPC lanes) implements the same interface, so the HTTP code does not change.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine (and torch) are only needed by implementations
    import torch

    from engine.request import EngineRequest, KVPull, RequestOutput
    from engine.tokenizer import Tokenizer


class EngineState(str, enum.Enum):
    """Admission gate of an engine: only ``SERVING`` admits new requests."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    DEAD = "dead"


class EngineDeadError(RuntimeError):
    """The engine failed and is dead for good (sticky): every pending and new request gets this."""


class EngineNotServingError(RuntimeError):
    """The engine does not admit new requests now (starting or draining); try another server."""


class EngineClient(abc.ABC):
    """Submit requests to one engine and stream its outputs back (asyncio side).

    Implementations must be usable from one asyncio event loop; they own the engine loop and stop
    it in :meth:`shutdown`.
    """

    @property
    @abc.abstractmethod
    def state(self) -> EngineState:
        """Current admission state."""

    @property
    @abc.abstractmethod
    def dead_reason(self) -> str | None:
        """Why the engine died (``None`` while alive)."""

    @property
    @abc.abstractmethod
    def tokenizer(self) -> "Tokenizer":
        """The model's tokenizer (encode, decode, chat template)."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Context window in tokens (prompt + output)."""

    @property
    @abc.abstractmethod
    def kv_cache(self) -> "torch.Tensor":
        """Block-major KV cache ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``.

        Only the blocks of a parked request or of a pending :class:`KVPull` may be touched from
        outside the engine loop.
        """

    @abc.abstractmethod
    def generate(self, request: "EngineRequest") -> AsyncIterator["RequestOutput | KVPull"]:
        """Submit ``request`` and yield its outputs until one has ``finished``.

        A ``generation_only`` request first yields one :class:`KVPull`; the caller fills those blocks
        and calls :meth:`kv_ready`. Closing the iterator early aborts the request.

        Raises:
            EngineDeadError: the engine is dead (at submit or while the request is pending).
            EngineNotServingError: the engine is starting or draining.
            engine.errors.RequestValidationError: the engine refused the request (e.g. too long).
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its blocks are freed."""

    @abc.abstractmethod
    def kv_ready(self, request_id: str, ok: bool) -> None:
        """Report that a :class:`KVPull`'s blocks were filled (``ok``) or that the pull failed."""

    @abc.abstractmethod
    def release_parked(self, request_id: str) -> None:
        """Free the parked KV blocks of a finished ``context_only`` request."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Snapshot: ``free_blocks``, ``total_blocks``, ``running``, ``waiting`` (counts)."""

    @abc.abstractmethod
    def drain(self) -> None:
        """Stop admitting new requests; in-flight ones finish."""

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the engine loop (bounded wait) and fail whatever is pending."""
