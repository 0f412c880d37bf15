"""Worker side of the generation role: pull a request's KV from the ctx server into its blocks.

When the engine admits a ``generation_only`` request it allocates blocks and asks for a
:class:`engine.request.KVPull` (the KV connector's scheduler side, engine.kv_connector; this role is
its worker side); this role copies the ctx lease's blocks ``first_block .. kv_block_count - 1`` into
them (a partial pull: the blocks before ``first_block`` were in this engine's prefix cache; none
left to copy = only the lease is released) on a small thread pool (each pull bounded by ``kv_transfer.timeout_ms``) and then tells
the engine (``kv_ready``) on the loop thread. A request aborted mid-pull keeps its blocks until the
copy has stopped writing into them. When a pull may start is :class:`gen_worker.kv_source.KVSources`'
call: at once (context_first), or once the ctx params arrive (generation_first: the frontend's
wait on the ctx server, then :meth:`GenKVRole.kv_source_ready`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.llm_engine import LLMEngine
from engine.request import EngineRequest, KVPull, RequestOutput
from executor.logprobs_format import from_wire
from executor.kv_role import KVMoved, KVTransferDone, RankShards, WorkerOps, WorkerRole
from executor.phases import PhaseError
from gen_worker.kv_park import KVParking
from gen_worker.kv_source import KVSources
from kv_transfer.lease import LeaseError
from kv_transfer.formatter import pull_plan
from kv_transfer.layout import KVLayout, KVLayoutMismatch, blocks_for_tokens, check_tp_pairing
from kv_transfer.stats import TransferStats
from kv_transfer.factory import KVClient, make_kv_client
from kv_transfer.wire import KVTransferError
from pdserve.config import KVTransferSettings
from pdserve.protocol import DisaggregatedParams

log = logging.getLogger(__name__)

MAX_CONCURRENT_PULLS = 4


class GenKVRole(WorkerRole):
    """Pulls the KV of ``generation_only`` requests; parks the KV of requests moved off it when it
    drains with ``move_kv`` (:class:`gen_worker.kv_park.KVParking`; ``host``/``port``: where that
    transceiver listens, 0 = any free port)."""

    name = "gen"
    can_move_kv = True

    def __init__(self, settings: KVTransferSettings, layout: KVLayout, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.settings, self.layout = settings, layout
        self.parking = KVParking(settings, host, port, self._moved_lease_freed)
        self._clients: dict[tuple[str, str], KVClient] = {}  # (scheme, layout) -> client, made on first use
        self._sources = KVSources()
        self._in_flight: dict[str, bool] = {}  # request id -> aborted while pulling
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_PULLS, thread_name_prefix="kv-pull")
        self._received = TransferStats()
        self._failures = 0
        self._blocks_pulled = 0   # blocks copied from ctx servers
        self._blocks_skipped = 0  # prompt blocks a partial pull did not copy (prefix cache hits)

    def start(self, engine: LLMEngine, ops: WorkerOps, shards: RankShards) -> None:
        self.engine, self.ops, self.shards = engine, ops, shards

    def on_submit(self, request: EngineRequest, disagg: DisaggregatedParams | None) -> None:
        if disagg is not None and disagg.request_type == "generation_only":
            self._sources.submitted(request.request_id, disagg)

    def on_output(self, out: RequestOutput) -> None:
        if out.moved is None:  # a moved request's final output, or a moved choice's last (n > 1)
            return
        try:
            params = self.parking.park(out, self.shards)
        except (OSError, RuntimeError, LeaseError) as err:  # no lease: free the blocks, fail the stream
            log.error("request %s: cannot park its KV to move it (%s); failing it", out.moved.park_id, err)
            self.engine.release_parked(out.moved.park_id)
            self.ops.deliver(out.request_id, PhaseError(f"drain could not park this request's KV: {err}", 503,
                                                        "service_unavailable"))
            return
        self.ops.deliver(out.request_id, KVMoved(out.request_id, params))

    def _moved_lease_freed(self, request_id: str) -> None:
        self.ops.post(lambda engine: engine.release_parked(request_id))

    def release(self, ctx_request_id: str) -> bool:
        return self.parking.release(ctx_request_id)

    def on_pull(self, pull: KVPull) -> None:
        try:
            ready = self._sources.allocated(pull)
        except KeyError:
            self._fail(pull.request_id, "no KV source for this request (not a generation_only request)", 500)
            return
        if ready is not None:
            self._start_pull(*ready)

    def kv_source_ready(self, request_id: str, params: DisaggregatedParams) -> None:
        ready = self._sources.source_ready(request_id, params)
        if ready is not None:
            self._start_pull(*ready)

    def _start_pull(self, pull: KVPull, src: DisaggregatedParams) -> None:
        num_blocks = (src.kv_block_count or blocks_for_tokens(pull.num_tokens, self.layout.block_size)) - pull.first_block
        if not 0 <= num_blocks <= len(pull.block_ids):
            self._fail(pull.request_id, f"ctx holds {num_blocks} KV blocks past block {pull.first_block}; "
                                        f"the engine allocated {len(pull.block_ids)}", 500)
            return
        with self._lock:
            self._in_flight[pull.request_id] = False
            self._blocks_skipped += pull.first_block
        self._pool.submit(self._pull, pull, src, pull.block_ids[:num_blocks])

    def _pull(self, pull: KVPull, src: DisaggregatedParams, dst: list[int]) -> None:
        rid, t0 = pull.request_id, time.perf_counter()
        error: str | None = None
        nbytes = 0
        try:
            nbytes = self._pull_shards(src, dst, pull.first_block)
        except (KVTransferError, KVLayoutMismatch) as err:
            error = f"KV transfer failed: {err}"
        except Exception as err:  # noqa: BLE001 - a pull thread must always report back
            log.exception("KV pull crashed")
            error = f"KV transfer failed: {type(err).__name__}: {err}"
        seconds = time.perf_counter() - t0
        with self._lock:
            aborted = self._in_flight.pop(rid, False)
            self._failures += bool(error)
            self._blocks_pulled += 0 if error else len(dst)
        if not error:
            self._received.observe(nbytes, seconds)
        if error:
            self._fail(rid, error, 502)
        elif not aborted:
            self.ops.deliver(rid, KVTransferDone(rid, nbytes, seconds))
        ok = error is None and not aborted
        # generation_first: the first tokens, their logprobs and the prompt's are known only now
        first, cached = list(src.first_gen_tokens or []), src.cached_tokens
        first_lp, prompt_lp = from_wire(src.first_gen_logprobs), from_wire(src.prompt_logprobs)
        self.ops.post(lambda engine: engine.kv_ready(rid, ok, first_token_ids=first, num_cached_tokens=cached,
                                                     first_token_logprobs=first_lp, prompt_logprobs=prompt_lp))

    def _pull_shards(self, src: DisaggregatedParams, dst: list[int], first: int) -> int:
        """Pull every gen rank's heads of the ctx lease blocks ``first ..`` into ``dst`` from the ctx
        ranks that hold them, then release the lease once (with no block to copy: only release).

        Equal TP sizes: ctx rank r → gen rank r straight into its cache. Different TP sizes: each
        contributing ctx rank's blocks land in a staging tensor and the formatter's head slice is
        copied into the gen rank's cache (:func:`kv_transfer.formatter.pull_plan`).
        """
        ctx_layouts = list(src.kv_layouts or [src.kv_layout])
        ctx_eps = list(src.kv_endpoints or [src.kv_endpoint])
        gen_layouts, caches = self.shards.layouts, self.shards.caches
        check_tp_pairing(gen_layouts, ctx_layouts)
        timeout_s = self.settings.timeout_ms / 1000.0
        single = len(ctx_layouts) == len(gen_layouts) == 1 and bool(dst)
        nbytes = 0
        if not dst:
            pass  # every prompt block was in this engine's prefix cache: nothing to copy
        elif len(ctx_layouts) == len(gen_layouts):
            for r, cache in enumerate(caches):
                client = self._client_for(ctx_eps[r], ctx_layouts[r])
                nbytes += client.pull(ctx_eps[r], src.ctx_request_id, ctx_layouts[r], cache, dst, timeout_s,
                                      release=single, src_first=first)
        else:
            heads = sum(l.num_kv_heads for l in ctx_layouts)
            index = torch.tensor(dst)
            for g, cache in enumerate(caches):
                for piece in pull_plan(heads, len(ctx_layouts), len(gen_layouts), g):
                    k = piece.ctx_rank
                    staging = torch.empty((len(dst), *cache.shape[1:4], ctx_layouts[k].num_kv_heads, cache.shape[5]),
                                          dtype=cache.dtype)
                    client = self._client_for(ctx_eps[k], ctx_layouts[k])
                    nbytes += client.pull(ctx_eps[k], src.ctx_request_id, ctx_layouts[k], staging,
                                          list(range(len(dst))), timeout_s, release=False, src_first=first)
                    cache[index, :, :, :, piece.dst_start:piece.dst_stop] = staging[..., piece.src_start:piece.src_stop, :]
        if not single:
            self._client_for(ctx_eps[0], ctx_layouts[0]).release(ctx_eps[0], src.ctx_request_id, timeout_s)
        return nbytes

    def _client_for(self, endpoint: str, layout: KVLayout) -> KVClient:
        """A transceiver that speaks the ctx server's backend (the endpoint's scheme) for ``layout``.

        A client declares the layout it receives into, so staging pulls (TP mismatch) use one client
        per ctx rank layout; clients are cached.
        """
        scheme = endpoint.partition("://")[0]
        if scheme not in ("tcp", "ucx", "cudaipc"):
            raise KVTransferError(f"unsupported KV endpoint {endpoint!r}")
        key = (scheme, layout.model_dump_json())
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = make_kv_client(scheme, layout, self.settings.same_host_reads)
                client.start()
        return client

    def _fail(self, rid: str, message: str, status: int) -> None:
        log.warning("request %s: %s", rid, message)
        self.ops.deliver(rid, PhaseError(message, status, "kv_transfer_error"))

    def intercept_abort(self, request_id: str) -> bool:
        if self.parking.release(request_id):  # moved: freed through its lease, after any pull in progress
            return True
        self._sources.forget(request_id)
        with self._lock:
            if request_id in self._in_flight:
                self._in_flight[request_id] = True  # freed by kv_ready(ok=False) once the copy stops
                return True
        return False

    def stats(self) -> dict:
        same_host = sum(getattr(c, "same_host_reads", 0) for c in list(self._clients.values()))
        return {"kv_transfer": {"received": self._received.snapshot()}, "kv_pull_failures": self._failures,
                "kv_same_host_reads": same_host, "kv_blocks_pulled": self._blocks_pulled,
                "kv_blocks_skipped": self._blocks_skipped, **self.parking.stats()}

    def stop(self) -> None:
        self.parking.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for client in self._clients.values():
            client.stop()


def make_worker_role(cfg, layout: KVLayout) -> GenKVRole:
    """The gen worker role of one server (``cfg``: :class:`pdserve.config.ServerConfig`)."""
    return GenKVRole(cfg.kv_transfer, layout, cfg.host, cfg.kv_port)
