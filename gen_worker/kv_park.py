"""A draining gen server's side of a KV move: park a moved request's blocks under a lease and serve them.

When a gen server drains with ``move_kv`` (``POST /admin/drain {"mode": "move_kv"}``), the engine
stops each movable request at a decode step boundary and keeps its blocks
(:meth:`engine.llm_engine.LLMEngine.move_out`, finish reason ``"moved"``). This module does with
those blocks exactly what a ctx server does with a prefill's (``ctx_worker.kv_role``): a
:class:`kv_transfer.lease.LeaseTable` holds them until the puller confirms (or the orchestrator
releases them, or the lease's timer runs out) and one KV transceiver per TP shard serves them. The
answer is the ``disaggregated_params`` a target gen server needs to pull them and decode on
(:meth:`KVParking.park`).

The transceivers start on the first move (engine loop thread), not with the server: a gen server that
never drains this way binds no KV port.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.request import RequestOutput
from executor.kv_role import RankShards
from kv_transfer.factory import KVServer, make_kv_server
from kv_transfer.layout import KVLayout, blocks_for_tokens
from kv_transfer.lease import LeaseTable
from kv_transfer.stats import TransferStats
from pdserve.config import KVTransferSettings
from pdserve.protocol import DisaggregatedParams

log = logging.getLogger(__name__)


class KVParking:
    """Leases and transceivers for the requests a draining gen server moves away.

    Args:
        settings: ``lease_ms`` (how long a moved request's blocks wait for their puller),
            ``timeout_ms`` (one pull), ``backend``, ``same_host_reads``.
        host, port: where the transceivers listen (port 0 = any free port; shard r uses port + r).
        on_free: ``on_free(request_id)`` once per lease (released, pulled, expired or shut down); it
            must free the engine's parked blocks (any thread).
    """

    def __init__(self, settings: KVTransferSettings, host: str, port: int, on_free: Callable[[str], None]) -> None:
        self.settings, self.host, self.port = settings, host, port
        self._on_free = on_free
        self.leases: LeaseTable | None = None
        self.servers: list[KVServer] = []
        self.layouts: list[KVLayout] = []
        self._sent = TransferStats()
        self.moved_total = 0
        self._lock = threading.Lock()
        self._choice_leases: dict[str, set[str]] = {}  # n > 1: request id -> its moved choices' park ids

    def _freed(self, park_id: str) -> None:
        """A lease ended (any thread): forget it as a choice lease, then free the engine's blocks."""
        with self._lock:
            for request_id, ids in list(self._choice_leases.items()):
                ids.discard(park_id)
                if not ids:
                    del self._choice_leases[request_id]
        self._on_free(park_id)

    def _start(self, shards: RankShards) -> None:
        self.leases = LeaseTable(lambda park_id, reason: self._freed(park_id))
        self.layouts = list(shards.layouts)
        for r, (cache, layout) in enumerate(zip(shards.caches, shards.layouts)):
            port = self.port + r if self.port else 0
            self.servers.append(make_kv_server(self.settings.backend, cache, layout, self.leases, self.host, port,
                                               timeout_s=self.settings.timeout_ms / 1000.0,
                                               on_sent=self._sent.observe,
                                               same_host_reads=self.settings.same_host_reads))
        self.leases.start()
        for server in self.servers:
            server.start()
        log.info("KV parking for moved requests serves at %s", self.servers[0].endpoint)

    def park(self, out: RequestOutput, shards: RankShards) -> DisaggregatedParams:
        """Lease the blocks of ``out`` (an output with finish reason ``moved``: an n = 1 request's
        final one, or a moved choice's last) and return what a target needs: the lease
        (``ctx_request_id`` = ``out.moved.park_id``: this request's id here, ``"<id>-c<i>"`` for
        choice i of an n > 1 request, ``kv_endpoint(s)``, ``kv_layout(s)``), ``kv_block_count`` /
        ``kv_num_tokens`` (prompt + outputs but the last), ``kv_block_hashes`` (partial pulls),
        ``prompt_token_ids``, ``first_gen_tokens`` (every output token so far: the target samples
        output position ``len(first_gen_tokens)`` next) and, for a choice, ``choice_index``.

        Raises OSError / RuntimeError when the transceivers cannot start, LeaseError when stopped."""
        moved = out.moved
        assert moved is not None and out.parked_block_ids is not None, "not a moved output"
        if self.leases is None:
            self._start(shards)
        assert self.leases is not None
        lease_s = self.settings.lease_ms / 1000.0
        self.leases.park(moved.park_id, out.parked_block_ids, moved.kv_num_tokens, lease_s)
        if moved.choice_index is not None:  # no pull before its params leave: registered in time
            with self._lock:
                self._choice_leases.setdefault(out.request_id, set()).add(moved.park_id)
        self.moved_total += 1
        layout = self.layouts[0]
        return DisaggregatedParams(
            request_type="context_only", ctx_request_id=moved.park_id, choice_index=moved.choice_index,
            prompt_token_ids=moved.token_ids[:moved.num_prompt_tokens],
            first_gen_tokens=moved.token_ids[moved.num_prompt_tokens:],
            kv_endpoint=self.servers[0].endpoint, kv_layout=layout,
            kv_endpoints=[s.endpoint for s in self.servers], kv_layouts=self.layouts,
            kv_block_count=blocks_for_tokens(moved.kv_num_tokens, layout.block_size),
            kv_num_tokens=moved.kv_num_tokens, lease_deadline=time.time() + lease_s,
            cached_tokens=out.num_cached_tokens, kv_block_hashes=[h.hex() for h in moved.block_hashes])

    def release(self, request_id: str) -> bool:
        """Free a moved request's lease now (or once its pull ends); ``request_id``: its park id (a
        moved choice's ``"<id>-c<i>"``), or an n > 1 request's id (every moved choice's lease: an
        abort). False if there is none."""
        if self.leases is None:
            return False
        if self.leases.release(request_id):
            return True
        with self._lock:
            choices = sorted(self._choice_leases.get(request_id, ()))
        return any([self.leases.release(park_id) for park_id in choices])

    def stats(self) -> dict:
        """``moved_leases`` (parked now), ``requests_moved`` (total), bytes/seconds served."""
        return {"moved_leases": len(self.leases) if self.leases is not None else 0,
                "requests_moved": self.moved_total, "kv_moved_sent": self._sent.snapshot()}

    def stop(self) -> None:
        """Stop the transceivers and free every lease left (bounded waits)."""
        for server in self.servers:
            server.stop()
        if self.leases is not None:
            self.leases.stop()
