"""Worker side of the context role: park handed-off blocks under a lease and serve them.

Runs next to the engine (the process that owns the KV cache). The lease table frees blocks when
the gen side confirms its pull, when the lease expires on its timer, or when the orchestrator
releases it; every free goes through the engine loop (``release_parked``).

generation_first: a gen server's wait for a ``disagg_request_id`` (``POST /disagg/lease``) is
answered from here once that context phase parked, finished or failed (``ctx_worker.lease_waits``);
a wait that ran out of time abandons the request (aborted, or its lease released).
"""

from __future__ import annotations

import logging
import os
import time

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, RequestOutput
from executor.logprobs_format import to_wire
from executor.kv_role import KVHandoff, RankShards, WorkerOps, WorkerRole
from ctx_worker.lease_waits import LeaseWaits
from engine.errors import RequestValidationError
from executor.phases import PhaseError
from kv_transfer.layout import KVLayout, blocks_for_tokens
from kv_transfer.lease import LeaseTable
from kv_transfer.stats import TransferStats
from kv_transfer.factory import KVServer, make_kv_server
from pdserve.config import KVTransferSettings
from pdserve.kv_wait import LeaseWaitAnswer
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
        self._first: dict[str, dict[int, RequestOutput]] = {}  # n > 1: id -> choice index -> its first output
        self._sent = TransferStats()
        self.leases: LeaseTable | None = None
        self.servers: list[KVServer] = []  # one per TP rank's shard, all on one lease table
        self.waits = LeaseWaits(settings.lease_ms / 1000.0)

    def start(self, engine: LLMEngine, ops: WorkerOps, shards: RankShards) -> None:
        self.engine, self.ops = engine, ops
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
        self.ops.post(lambda engine: self._freed(engine, ctx_request_id))

    def _freed(self, engine: LLMEngine, ctx_request_id: str) -> None:
        engine.release_parked(ctx_request_id)
        disagg = self.waits.disagg_of(ctx_request_id)
        if disagg is not None:
            self.waits.forget(disagg)  # a later wait must not be sent to a lease that is gone
        self.waits.unbind(ctx_request_id)

    def _on_sent(self, nbytes: int, seconds: float) -> None:
        self._sent.observe(nbytes, seconds)

    def on_submit(self, request: EngineRequest, disagg: DisaggregatedParams | None) -> None:
        if disagg is not None and disagg.request_type == "context_only":
            did = disagg.disagg_request_id
            if did is not None:
                known = self.waits.outcome(did)
                if known is not None and known.state == "timeout":
                    raise RequestValidationError(f"the gen server stopped waiting for {did} before it arrived")
                self.waits.bind(did, request.request_id)
            self._pending[request.request_id] = (did, list(request.prompt_token_ids), request.cache_salt)

    def on_output(self, out: RequestOutput) -> None:
        if not out.finished:  # n > 1: an earlier choice of the request (engine.choices)
            self._first.setdefault(out.request_id, {})[out.index] = out
            return
        outs = {**self._first.pop(out.request_id, {}), out.index: out}
        firsts = {i: list(o.new_token_ids) for i, o in outs.items()}
        disagg_id, prompt, salt = self._pending.pop(out.request_id, (None, [], None))
        # parked iff the request goes on: n > 1 parks when any choice does, whatever this one's finish_reason
        if out.parked_block_ids is None:
            self._settle_unparked(out, disagg_id)
            return
        if not out.parked_block_ids:
            self.ops.deliver(out.request_id, PhaseError("engine handed off without parked KV blocks", 500, "internal"))
            self._settle_unparked(out, disagg_id)
            return
        num_tokens = len(prompt)
        lease_s = self.settings.lease_ms / 1000.0
        self.leases.park(out.request_id, out.parked_block_ids, num_tokens, lease_s)
        params = DisaggregatedParams(
            request_type="context_only", disagg_request_id=disagg_id, ctx_request_id=out.request_id,
            first_gen_tokens=[t for i in sorted(firsts) for t in firsts[i]], prompt_token_ids=prompt, kv_endpoint=self.endpoint, kv_layout=self.layout,
            kv_endpoints=[s.endpoint for s in self.servers], kv_layouts=self.shard_layouts,
            kv_block_count=blocks_for_tokens(num_tokens, self.layout.block_size),
            lease_deadline=time.time() + lease_s, cached_tokens=out.num_cached_tokens,
            kv_block_hashes=[h.hex() for h in self.hasher.hashes(prompt, salt)],
            **self._logprobs_of([outs[i] for i in sorted(outs)]))
        self.ops.deliver(out.request_id, KVHandoff(out.request_id, params))
        if disagg_id is not None:
            self.waits.settle(disagg_id, LeaseWaitAnswer(state="parked", disaggregated_params=params))

    @staticmethod
    def _logprobs_of(outs: list[RequestOutput]) -> dict:
        """``first_gen_logprobs`` (one per first token, choices in order) and ``prompt_logprobs``
        of a parked request's outputs, when it asked for them: a generation_first gen server gets
        them only here (the lease wait's answer), a context_first one from the ctx answer."""
        extra: dict = {}
        if all(o.new_logprobs is not None for o in outs):
            extra["first_gen_logprobs"] = to_wire([lp for o in outs for lp in o.new_logprobs])
        prompt_lp = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
        if prompt_lp is not None:
            extra["prompt_logprobs"] = to_wire(prompt_lp)
        return extra

    def _settle_unparked(self, out: RequestOutput, disagg_id: str | None) -> None:
        """A context phase that ended without parking: nothing for a gen server to pull."""
        self.waits.unbind(out.request_id)
        if disagg_id is None:
            return
        if out.finish_reason in (None, "abort"):
            answer = LeaseWaitAnswer(state="failed", message=f"the context phase ended ({out.finish_reason or 'no KV'})")
        else:
            answer = LeaseWaitAnswer(state="finished", message=f"the first token ended the request ({out.finish_reason})")
        if (self.waits.outcome(disagg_id) or answer).state != "timeout":  # an abandoned id stays abandoned
            self.waits.settle(disagg_id, answer)

    # ---- generation_first waits (engine loop thread) ----------------------------------------
    def await_lease(self, disagg_request_id: str, call_id: int, reply) -> None:
        self.waits.wait(disagg_request_id, call_id, reply)

    def cancel_lease_wait(self, disagg_request_id: str, call_id: int, abandon: bool) -> None:
        self.waits.cancel(disagg_request_id, call_id)
        if not abandon:
            return
        # The gen server's ctx_wait_ms ran out: nobody will pull, so free this side's blocks too.
        rid = self.waits.request_of(disagg_request_id)
        self.waits.settle(disagg_request_id, LeaseWaitAnswer(state="timeout", message="the gen server stopped waiting"))
        if rid is None:
            return  # not arrived yet: on_submit refuses it when it comes
        log.warning("request %s (%s): the gen server stopped waiting for its KV; freeing it", rid, disagg_request_id)
        if rid in self._pending:  # queued or prefilling: fail it with a clear error, then free its blocks
            self.ops.deliver(rid, PhaseError("the gen server stopped waiting for this request's KV "
                                             "(its kv_transfer.ctx_wait_ms ran out)", 504, "ctx_wait_timeout"))
        if not self.intercept_abort(rid):
            self.engine.abort_request(rid)

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
                "lease_waits": self.waits.num_waiting(), "lease_waits_answered": self.waits.answered,
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
