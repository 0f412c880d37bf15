"""The ``generation_only`` phase: allocate blocks, pull the prompt's KV from the ctx server, decode.

The engine admits the request when blocks are free and asks for a :class:`KVPull`; this handler
copies ``kv_block_count`` blocks from the ctx transceiver into them (in a worker thread, bounded by
``kv_transfer.timeout_ms``), tells the engine the KV landed, and streams the decode. The first
output is ``first_gen_tokens`` (sampled by the ctx server), sent once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from engine.request import EngineRequest, KVPull, RequestOutput
from executor.engine_client import EngineClient
from executor.http_server import ServerState
from executor.metrics import ServerMetrics
from executor.phases import PhaseAnswer, PhaseError
from kv_transfer.layout import KVLayout, KVLayoutMismatch, blocks_for_tokens, check_pairing
from kv_transfer.tcp_backend import TcpKVClient
from kv_transfer.wire import KVTransferError
from pdserve.protocol import DisaggregatedParams

log = logging.getLogger(__name__)


class GenerationPhase:
    """Runs ``generation_only`` requests: KV pull, then decode."""

    def __init__(self, client: EngineClient, kv_client: TcpKVClient, layout: KVLayout, timeout_ms: int,
                 metrics: ServerMetrics) -> None:
        self.client, self.kv_client, self.layout = client, kv_client, layout
        self.timeout_s, self.metrics = timeout_ms / 1000.0, metrics

    async def __call__(self, request: EngineRequest, params: DisaggregatedParams | None,
                       answer: PhaseAnswer) -> AsyncIterator[RequestOutput]:
        assert params is not None and params.kv_layout is not None  # enforced by DisaggregatedParams
        try:
            check_pairing(self.layout, params.kv_layout)
        except KVLayoutMismatch as err:
            self.metrics.errors.labels(kind="kv_layout_mismatch").inc()
            raise PhaseError(str(err), 409, "kv_layout_mismatch") from None
        async for item in self.client.generate(request):
            if isinstance(item, KVPull):
                await self._pull(item, params)
                continue
            yield item

    async def _pull(self, pull: KVPull, params: DisaggregatedParams) -> None:
        num_blocks = params.kv_block_count or blocks_for_tokens(pull.num_tokens, self.layout.block_size)
        if num_blocks > len(pull.block_ids):
            self.client.kv_ready(pull.request_id, ok=False)
            raise PhaseError(f"ctx holds {num_blocks} KV blocks; the engine allocated {len(pull.block_ids)}", 500, "internal")
        t0 = time.perf_counter()
        try:
            nbytes = await asyncio.to_thread(
                self.kv_client.pull, params.kv_endpoint, params.ctx_request_id, params.kv_layout,
                self.client.kv_cache, pull.block_ids[:num_blocks], self.timeout_s)
        except (KVTransferError, KVLayoutMismatch) as err:
            self.client.kv_ready(pull.request_id, ok=False)
            self.metrics.errors.labels(kind="kv_transfer").inc()
            raise PhaseError(f"KV transfer failed: {err}", 502, "kv_transfer_error") from None
        seconds = time.perf_counter() - t0
        self.metrics.kv_bytes.labels(direction="received").inc(nbytes)
        self.metrics.kv_seconds.labels(direction="received").observe(seconds)
        log.debug("pulled %d blocks (%d bytes) for %s in %.1f ms", num_blocks, nbytes, pull.request_id, seconds * 1e3)
        self.client.kv_ready(pull.request_id, ok=True)


def setup_gen_role(state: ServerState, client: EngineClient) -> None:
    """Add the ``generation_only`` handler with a TCP KV client."""
    cfg = state.config
    state.handlers["generation_only"] = GenerationPhase(client, TcpKVClient(state.kv_layout), state.kv_layout,
                                                        cfg.kv_transfer.timeout_ms, state.metrics)
