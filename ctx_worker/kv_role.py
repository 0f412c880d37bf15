"""Worker side of the context role: park handed-off blocks under a lease and serve them.

Runs next to the engine (the process that owns the KV cache). The lease table frees blocks when
the gen side confirms its pull, when the lease expires on its timer, or when the orchestrator
releases it; every free goes through the engine loop (``release_parked``).
"""

from __future__ import annotations

import logging
import os
import time

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestOutput
from executor.kv_role import KVHandoff, RankShards, WorkerOps, WorkerRole
from executor.phases import PhaseError
from kv_transfer.layout import KVLayout, blocks_for_tokens
from kv_transfer.lease import LeaseTable
from kv_transfer.stats import TransferStats
from kv_transfer.factory import KVServer, make_kv_server
from pdserve.config import KVTransferSettings
from pdserve.protocol import DisaggregatedParams

log = logging.getLogger(__name__)


class CtxKVRole(WorkerRole):
    """Parks ``context_only`` requests' blocks and serves them to gen servers.

    Args:
        settings: lease and timeout settings (``lease_ms``, ``timeout_ms``).
        layout: this rank's KV layout (checked against every puller's).
        host, port: where the KV transceiver listens (port 0 = any free port).
    """

    name = "ctx"

    def __init__(self, settings: KVTransferSettings, layout: KVLayout, host: str, port: int,
                 pull_delay_s: float = 0.0) -> None:
        self.settings, self.layout, self.host, self.port = settings, layout, host, port
        self.pull_delay_s = pull_delay_s
        self._pending: dict[str, tuple[str | None, list[int], str | None]] = {}  # id -> (disagg id, prompt, salt)
        self._sent = TransferStats()
        self.leases: LeaseTable | None = None
        self.servers: list[KVServer] = []  # one per TP rank's shard, all on one lease table

    def start(self, engine: LLMEngine, ops: WorkerOps, shards: RankShards) -> None:
        self.ops = ops
        self.hasher = engine.hasher  # names the parked blocks in the answer (partial pulls)
        self.shard_layouts = list(shards.layouts)
        self.leases = LeaseTable(self._on_free, self.pull_delay_s)
        for r, (cache, layout) in enumerate(zip(shards.caches, shards.layouts)):
            port = self.port + r if self.port else 0
            self.servers.append(make_kv_server(self.settings.backend, cache, layout, self.leases, self.host, port,
                                               timeout_s=self.settings.timeout_ms / 1000.0, on_sent=self._on_sent,
                                               same_host_reads=self.settings.same_host_reads))
        self.leases.start()
        for server in self.servers:
            server.start()

    @property
    def endpoint(self) -> str:
        assert self.servers, "start() first"
        return self.servers[0].endpoint

    def _on_free(self, ctx_request_id: str, reason: str) -> None:
        self.ops.post(lambda engine: engine.release_parked(ctx_request_id))

    def _on_sent(self, nbytes: int, seconds: float) -> None:
        self._sent.observe(nbytes, seconds)

    def on_submit(self, request: EngineRequest, disagg: DisaggregatedParams | None) -> None:
        if disagg is not None and disagg.request_type == "context_only":
            self._pending[request.request_id] = (disagg.disagg_request_id, list(request.prompt_token_ids),
                                                 request.cache_salt)

    def on_output(self, out: RequestOutput) -> None:
        if not out.finished:
            return
        disagg_id, prompt, salt = self._pending.pop(out.request_id, (None, [], None))
        if out.finish_reason is not None or out.parked_block_ids is None:
            return
        if not out.parked_block_ids:
            self.ops.deliver(out.request_id, PhaseError("engine handed off without parked KV blocks", 500, "internal"))
            return
        num_tokens = len(prompt)
        lease_s = self.settings.lease_ms / 1000.0
        self.leases.park(out.request_id, out.parked_block_ids, num_tokens, lease_s)
        params = DisaggregatedParams(
            request_type="context_only", disagg_request_id=disagg_id, ctx_request_id=out.request_id,
            first_gen_tokens=list(out.new_token_ids), prompt_token_ids=prompt, kv_endpoint=self.endpoint, kv_layout=self.layout,
            kv_endpoints=[s.endpoint for s in self.servers], kv_layouts=self.shard_layouts,
            kv_block_count=blocks_for_tokens(num_tokens, self.layout.block_size),
            lease_deadline=time.time() + lease_s, cached_tokens=out.num_cached_tokens,
            kv_block_hashes=[h.hex() for h in self.hasher.hashes(prompt, salt)])
        self.ops.deliver(out.request_id, KVHandoff(out.request_id, params))

    def intercept_abort(self, request_id: str) -> bool:
        # A parked request is freed through its lease, which waits for an in-progress pull.
        return self.leases is not None and self.leases.release(request_id)

    def release(self, ctx_request_id: str) -> bool:
        return self.leases is not None and self.leases.release(ctx_request_id)

    def stats(self) -> dict:
        leases = self.leases
        sent = {"kv_transfer": {"sent": self._sent.snapshot()}}
        if leases is None:
            return sent
        return {"kv_endpoint": self.endpoint if self.servers else None, "parked_leases": len(leases),
                "leases_expired": leases.expired_total, "leases_released": leases.released_total, **sent}

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        if self.leases is not None:
            self.leases.stop()


PULL_DELAY_ENV = "PDSERVE_TEST_KV_PULL_DELAY_S"  # fault-injection tests: hold each pull this long first


def make_worker_role(cfg, layout: KVLayout) -> CtxKVRole:
    """The ctx worker role of one server (``cfg``: :class:`pdserve.config.ServerConfig`)."""
    delay = float(os.environ.get(PULL_DELAY_ENV, "0"))
    if delay:
        log.warning("%s=%s: every KV pull is held %.1f s (fault-injection tests only)", PULL_DELAY_ENV, delay, delay)
    return CtxKVRole(cfg.kv_transfer, layout, cfg.host, cfg.kv_port, pull_delay_s=delay)
