"""Tensor parallelism: rank context, head/FFN partition, rank-0 → follower messages.

Rank k of T holds the contiguous GQA groups [floor(k*G/T), floor((k+1)*G/T)) of the G KV heads
(a group is one KV head plus the query heads that read it), so T need not divide G: SmolLM2's
3 KV heads over TP=2 give rank 0 two groups and rank 1 one. The FFN intermediate dimension is
split the same way. Everything else (embeddings, norms, lm_head) is replicated.

Rank 0 owns the scheduler and sampling; before each forward it broadcasts a `TPMessage` carrying
the `ExecPlan`, and the followers (`LLMEngine.run_follower`) run the same forward on their shard.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class TPContext:
    """This process's place in its tensor-parallel group.

    size == 1: no TP, torch.distributed is never touched. group: the process group of the
    all-reduces; cpu_group: the (gloo) group the plans travel on (== group for gloo).
    timeout_s: the process groups' timeout, which bounds every blocking collective.
    startup_group: a gloo group bounded by the rendezvous timeout instead (``init_tp``'s
    connect_timeout_s), for the start-up barriers: ranks load weights and rank 0 a tokenizer at
    different speeds, and that skew is start-up time, not a stalled peer. None: cpu_group.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    cpu_group: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    startup_group: Any = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"bad TP rank {self.rank} of size {self.size}")

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: schedules, samples and emits outputs."""
        return self.rank == 0


NO_TP = TPContext()


def split_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """[floor(rank*n/size), floor((rank+1)*n/size)): contiguous, as even as possible."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad TP rank {rank} of size {size}")
    return rank * n // size, (rank + 1) * n // size


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """Global KV heads [start, stop) held by `rank` of `size` (uneven splits allowed).

    Raises ValueError when a rank would get no KV head (size > num_kv_heads).
    """
    if num_kv_heads < size:
        raise ValueError(f"{num_kv_heads} KV heads cannot be split over tp_size={size}")
    return split_range(num_kv_heads, rank, size)


def init_tp(rank: int, size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
            backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S,
            connect_timeout_s: float | None = None) -> TPContext:
    """Join the TP group (torch.distributed rendezvous on master_addr:master_port).

    timeout_s bounds every collective afterwards; connect_timeout_s (default timeout_s) bounds the
    rendezvous, which may wait for slower-starting ranks. size == 1 returns a context without
    touching torch.distributed. With "nccl" a second, gloo group carries the plans (CPU objects).
    Raises RuntimeError/ValueError from torch when the rendezvous fails or times out.
    """
    if size == 1:
        return TPContext(rank=0, size=1, timeout_s=timeout_s)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"TP backend must be 'gloo' or 'nccl', got {backend!r}")
    import torch.distributed as dist
    timeout = timedelta(seconds=timeout_s)
    connect = timedelta(seconds=connect_timeout_s or timeout_s)
    dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=size, timeout=max(timeout, connect))
    group = dist.group.WORLD
    if connect != timeout:  # the world group keeps the rendezvous timeout: use a fresh group
        group = dist.new_group(backend=backend, timeout=timeout)
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    startup_group = cpu_group
    if connect != timeout:  # every rank creates the same groups in the same order
        startup_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=connect)
    log.info("TP rank %d/%d joined (%s, timeout %.1f s)", rank, size, backend, timeout_s)
    return TPContext(rank=rank, size=size, group=group, cpu_group=cpu_group, timeout_s=timeout_s,
                     startup_group=startup_group)


def all_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """Sum x over the TP group in place (identity without TP); returns x."""
    if tp.enabled:
        import torch.distributed as dist
        dist.all_reduce(x, group=tp.group)
    return x


# ---- rank 0 → follower messages ---------------------------------------------------------------
RUN, EXTRA, KEEPALIVE, STOP = "run", "extra", "keepalive", "stop"


@dataclass
class TPMessage:
    """One broadcast from rank 0. kind RUN carries a plan; any kind but STOP may carry an extra."""

    kind: str
    plan: Any = None            # engine.model_runner.ExecPlan for RUN
    extra: Any = None
    has_extra: bool = False


def broadcast_message(tp: TPContext, msg: TPMessage | None) -> TPMessage:
    """Rank 0 passes msg, followers None; every rank returns the message.

    Blocks at most the group's timeout, then raises RuntimeError (e.g. a peer died or stalled).
    """
    import torch.distributed as dist
    box = [msg]
    dist.broadcast_object_list(box, group=tp.cpu_group, group_src=0)
    return box[0]


class PlanBroadcaster:
    """Rank 0's sending side: plans, extras, STOP, and keepalives from a daemon thread.

    Followers wait for the next message inside a collective bounded by the group's timeout, so an
    idle rank 0 must still speak: the thread sends a KEEPALIVE after timeout/4 s of silence. The
    lock makes each broadcast *and the forward that follows it* one unit, so a keepalive can never
    land between a plan and that plan's all-reduces (the ranks' collective order must match).
    If rank 0 dies, so does the thread, and the followers' wait fails at once (peer gone).
    """

    def __init__(self, tp: TPContext):
        self.tp = tp
        self.lock = threading.RLock()
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keepalive_loop, name="tp-keepalive",
                                        daemon=True)
        self._thread.start()

    def send(self, msg: TPMessage) -> None:
        """Broadcast msg (callers that then run a forward hold self.lock around both)."""
        with self.lock:
            broadcast_message(self.tp, msg)
            self._last = time.monotonic()

    def keepalive(self) -> None:
        """Send a KEEPALIVE if nothing went out for timeout/4 s (skipped while a step runs)."""
        if not self.lock.acquire(blocking=False):
            return
        try:
            if time.monotonic() - self._last > self.tp.timeout_s / 4:
                self.send(TPMessage(KEEPALIVE))
        finally:
            self.lock.release()

    def stop(self) -> None:
        """Send STOP (followers' run_follower returns) and end the keepalive thread."""
        self._stop.set()
        self.send(TPMessage(STOP))
        self._thread.join(timeout=self.tp.timeout_s)

    def _keepalive_loop(self) -> None:
        while not self._stop.wait(self.tp.timeout_s / 8):
            try:
                self.keepalive()
            except Exception:  # a follower is gone: the next step() raises it to the caller
                log.exception("TP keepalive failed; stopping keepalives")
                return


def barrier(tp: TPContext, startup: bool = False) -> None:
    """All ranks meet, bounded by the group's timeout (``startup``: by the rendezvous timeout, see
    TPContext.startup_group); no-op without TP. Raises RuntimeError from torch on a timeout."""
    if tp.enabled:
        import torch.distributed as dist
        dist.barrier(group=(tp.startup_group or tp.cpu_group) if startup else tp.cpu_group)
