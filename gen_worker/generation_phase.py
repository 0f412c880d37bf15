"""Frontend side of the generation role: the ``generation_only`` handler.

The worker side (``gen_worker.kv_role``) pulls the KV; this handler refuses a mismatched KV layout
before anything is allocated (409, naming both values) and records the pull in the metrics. The
first output is ``first_gen_tokens`` (sampled by the ctx server), sent once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from engine.request import EngineRequest, RequestOutput
from executor.engine_client import EngineClient
from executor.http_server import ServerState
from executor.kv_role import KVTransferDone
from executor.metrics import ServerMetrics
from executor.phases import PhaseAnswer, PhaseError
from kv_transfer.layout import KVLayout, KVLayoutMismatch, check_tp_pairing
from pdserve.protocol import DisaggregatedParams


class GenerationPhase:
    """Runs ``generation_only`` requests: KV pull (worker side), then decode."""

    def __init__(self, client: EngineClient, layouts: list[KVLayout], metrics: ServerMetrics) -> None:
        self.client, self.layouts, self.metrics = client, layouts, metrics

    async def __call__(self, request: EngineRequest, params: DisaggregatedParams | None,
                       answer: PhaseAnswer) -> AsyncIterator[RequestOutput]:
        assert params is not None and params.kv_layout is not None  # enforced by DisaggregatedParams
        try:
            check_tp_pairing(self.layouts, params.kv_layouts or [params.kv_layout])
        except KVLayoutMismatch as err:
            self.metrics.errors.labels(kind="kv_layout_mismatch").inc()
            raise PhaseError(str(err), 409, "kv_layout_mismatch") from None
        async for item in self.client.generate(request, params):
            if isinstance(item, KVTransferDone):  # counted by the worker side (pdserve_kv_transfer_*)
                continue
            yield item


def setup_gen_frontend(state: ServerState) -> None:
    """Add the ``generation_only`` handler to a gen server."""
    state.handlers["generation_only"] = GenerationPhase(state.client, state.kv_layouts or [state.kv_layout], state.metrics)
