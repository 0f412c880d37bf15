"""Entry point of one worker rank: ``mpiexec -n TP python -m executor.worker_main --ipc-dir DIR``.

Start-up handshake with the server's proxy (frontend 0), over a DEALER → ROUTER socket:
1. every rank sends :class:`RankHello` (rank, pid, start time) as soon as MPI is up, so the proxy
   knows the pids even of ranks that later fail;
2. each rank loads its engine shard; a failure sends :class:`RankFailed` (cause) and exits 1;
3. rank 0 binds the ingress and starts its role, every rank sends :class:`RankReady`;
4. each rank waits for :class:`Ack` (bounded) and only then serves: the proxy attaches its death
   callbacks after acking, so a rank that dies during start-up takes the start-up failure path.

Rank 0 then runs :class:`executor.engine_loop.EngineLoop` over
:class:`executor.lane_transport.LaneTransport`; the followers run rank 0's plans.

The launch spec (``spec.json``: the server config, the worker-role plugin, socket addresses) and
the HMAC key (``key``) are files in the private IPC directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import traceback
from pathlib import Path

import zmq

from executor.ipc import Codec
from pdserve.devices import is_cuda, tp_rank_device
from executor.messages import Ack, RankFailed, RankHello, RankReady
from executor.monitor import proc_start_time
from executor.rank_threads import env_rank, pin_engine_thread, prepare, release_main_thread
from pdserve.cpu_bind import RankCores

log = logging.getLogger("pdserve.worker")

ACK_TIMEOUT_MS = 60_000
CRASH_ENV = "PDSERVE_TEST_CRASH_RANK"  # tests: make this rank fail during start-up


def _handshake_socket(zctx: zmq.Context, addr: str, rank: int) -> zmq.Socket:
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(addr)
    return sock


def kv_cache_file(ipc: Path, rank: int) -> Path:
    """Where TP rank ``rank`` keeps its KV cache (shared memory file rank 0 maps)."""
    return ipc / f"kv_rank{rank}.bin"


def init_tensor_parallel(comm, rank: int, size: int, timeout_s: float, device: str = "cpu"):
    """Join the TP group: rank 0 picks a free loopback port and tells the others over MPI. The
    group is NCCL on a CUDA ``device`` (each rank on its own GPU, pdserve.devices.tp_rank_device),
    else gloo."""
    if size == 1:
        return None
    import socket

    from engine.tp import init_tp

    port = None
    if rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = comm.bcast(port, root=0)
    from pdserve.devices import tp_backend, tp_rank_device

    if tp_backend(device) == "nccl":
        import torch

        torch.cuda.set_device(torch.device(tp_rank_device(device, rank)))  # before NCCL picks a GPU
    return init_tp(rank, size, "127.0.0.1", port, backend=tp_backend(device), timeout_s=timeout_s)


def build_worker(spec: dict, rank: int, size: int, tp, ipc: Path):
    """Load this rank's engine shard; rank 0 also builds the worker role. Returns (engine, role, info)."""
    from executor.role_plugins import load_plugin
    from executor.server_setup import kv_layout, make_engine
    from pdserve.config import ServerConfig

    if os.environ.get(CRASH_ENV) == str(rank):
        raise RuntimeError(f"injected start-up crash ({CRASH_ENV}={rank})")
    cfg = ServerConfig.model_validate(spec["server"])
    # Followers' caches are files rank 0 maps (in the IPC dir: /dev/shm where possible); rank 0's
    # own cache is anonymous memory (huge pages).
    if is_cuda(cfg.engine.device):  # one GPU per rank; a CUDA cache is device memory, not a shared file
        engine = make_engine(cfg, tp, device=tp_rank_device(cfg.engine.device, rank))
    else:
        engine = make_engine(cfg, tp, kv_cache_file=str(kv_cache_file(ipc, rank)) if rank > 0 else None)
    if rank > 0:  # a follower holds only its model shard and KV cache
        return engine, None, {}
    layouts = [kv_layout(cfg, engine, r, size) for r in range(size)]
    role = load_plugin(spec["role_plugin"])(cfg, layouts[0])
    mc = engine.model_config
    info = {"max_model_len": engine.max_model_len, "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids), "kv_layout": layouts[0].model_dump(),
            "kv_layouts": [layout.model_dump() for layout in layouts],
            "model_path": str(spec["server"]["model"]["path"])}
    return engine, role, info


def rank_shards(engine, info: dict, ipc: Path, size: int):
    """Rank 0's view of every rank's KV cache: its own, plus the followers' shared-memory files
    (unlinked once mapped: the mappings keep the memory)."""
    import torch

    from executor.kv_role import RankShards
    from pdserve.protocol import KVLayoutModel

    layouts = [KVLayoutModel.model_validate(x) for x in info["kv_layouts"]]
    caches = [engine.kv_cache]
    if size > 1 and engine.kv_cache.is_cuda:
        # Why refuse: followers' CUDA caches are not files rank 0 can map; KV transfer of them needs a
        # CUDA IPC handle per rank, not built yet (issue 12 note). Single-rank CUDA servers work.
        raise RuntimeError("engine.tp_size > 1 with a CUDA device: rank 0 cannot reach the follower ranks' "
                           "KV caches for KV transfer yet (per-rank CUDA IPC handles are not built)")
    for r in range(1, size):
        shape = (*engine.kv_cache.shape[:4], layouts[r].num_kv_heads, engine.kv_cache.shape[5])
        numel = 1
        for d in shape:
            numel *= d
        path = kv_cache_file(ipc, r)
        caches.append(torch.from_file(str(path), shared=True, size=numel, dtype=engine.kv_cache.dtype).view(shape))
        path.unlink()  # both ranks hold it mapped now; nothing is left behind if the server is killed
    return RankShards(caches, layouts)


def plan_threads(spec: dict) -> tuple[RankCores, Exception | None]:
    """Steps 1-2 of executor.rank_threads: plan this rank's cores, set the OpenMP binding, load
    torch, give the main thread its whole mask back. Sets the engine's ``num_threads`` to the
    plan's in ``spec``. Returns the plan (no cores on an error) and the error, if any."""
    engine = spec["server"]["engine"]
    allowed = os.sched_getaffinity(0)
    try:
        plan = prepare(engine["cpu_bind"], engine["num_threads"], engine["tp_size"], env_rank(),
                       engine.get("openmp_wait", "auto"))
    except (ValueError, RuntimeError) as err:
        return RankCores((), engine["num_threads"], str(err)), err
    if plan.cores:
        import torch  # noqa: F401 - its OpenMP runtime reads the binding now and pins this thread

        release_main_thread(allowed)
        engine["num_threads"] = plan.threads
    return plan, None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m executor.worker_main")
    p.add_argument("--ipc-dir", required=True)
    args = p.parse_args(argv)
    ipc = Path(args.ipc_dir)
    spec = json.loads((ipc / "spec.json").read_text())
    # The OpenMP binding (engine.cpu_bind) is read once, when torch's OpenMP runtime loads: plan it
    # first, before UCX (whose preload imports torch) and MPI; a bad plan is reported after the hello.
    plan, bind_error = plan_threads(spec)
    # Load UCX before MPI: the mpich wheel brings its own libucs, and whichever loads first wins;
    # ucxx loaded after it fails with "undefined symbol: ucs_ifname_to_ndev_index".
    backend = spec["server"]["kv_transfer"]["backend"]
    if backend in ("auto", "ucx"):
        from kv_transfer.factory import preload_ucx

        preload_ucx()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    log.info("%s", plan.reason)
    codec = Codec((ipc / "key").read_bytes())
    zctx = zmq.Context()
    hs = _handshake_socket(zctx, spec["ready_addr"], rank)
    pid = os.getpid()
    hs.send(codec.encode(RankHello(rank, pid, proc_start_time(pid))))
    try:
        if bind_error is not None:
            raise bind_error
        if plan.cores and rank != env_rank():
            raise RuntimeError(f"MPI rank {rank} but PMI_RANK {env_rank()}: engine.cpu_bind planned the wrong cores")
        tp = init_tensor_parallel(comm, rank, size, float(spec.get("tp_timeout_s", 600)),
                                  spec["server"]["engine"]["device"])
        engine, role, info = build_worker(spec, rank, size, tp, ipc)
        comm.Barrier()  # every rank's KV cache file exists before rank 0 maps them
        loop = transport = None
        if rank == 0:
            from executor.engine_loop import EngineLoop
            from executor.lane_transport import LaneTransport
            from executor.step_guard import exit_rank, guard_engine

            transport = LaneTransport(codec, spec["ingress_addr"], spec["lane_addrs"],
                                      frontend=(spec["frontend_pid"], spec.get("frontend_start_time")))
            loop = EngineLoop(engine, role, transport, rank_shards(engine, info, ipc, size))
            # A hung step (e.g. a collective) is invisible to the pidfds: the watchdog ends this rank.
            guard_engine(engine, float(spec["server"]["engine"]["step_timeout_s"]), exit_rank(spec["lane_addrs"], codec))
        # last: the threads started above keep the whole mask; this thread runs the steps on cores[0]
        pin_engine_thread(plan)
    except Exception as err:  # noqa: BLE001 - reported to the proxy, then the rank exits
        cause = f"{type(err).__name__}: {err}"
        log.error("start-up failed: %s\n%s", cause, traceback.format_exc())
        hs.send(codec.encode(RankFailed(rank, cause)))
        hs.close()
        return 1
    hs.send(codec.encode(RankReady(rank, info)))
    if not hs.poll(ACK_TIMEOUT_MS):
        log.error("no ack from the proxy within %d ms; exiting", ACK_TIMEOUT_MS)
        return 1
    if not isinstance(codec.decode(hs.recv()), Ack):
        log.error("the proxy answered READY with something other than an ack; exiting")
        return 1
    log.info("serving")
    if loop is None:  # a tensor-parallel follower: run rank 0's plans until it says stop
        engine.run_follower()
        hs.close()
        return 0
    try:
        ok = loop.run_or_report(f"worker rank {rank}")  # a failure: the frontends learn the engine is dead
    finally:
        if size > 1:
            engine.stop_followers()
        engine.close()
        transport.close()
        hs.close()
        zctx.term()
        if transport.frontend_exited:
            remove_orphaned_ipc_dir(ipc)
    return 0 if ok else 1


def remove_orphaned_ipc_dir(ipc: Path) -> None:
    """Remove the server's IPC directory (key, spec, sockets) after frontend 0 was killed.

    The proxy in frontend 0 removes it on a clean stop; a SIGKILLed frontend cannot, and each
    restart would leave one more ``/dev/shm/pdserve-*`` behind. Rank 0 is the last process that
    uses it (followers and attached frontends stop on the same pidfd). A failure is logged, not raised.
    """
    try:
        shutil.rmtree(ipc)
        log.info("removed the IPC directory %s left by the dead frontend 0", ipc)
    except OSError as err:
        log.warning("could not remove the IPC directory %s: %s", ipc, err)


def exit_now(code: int) -> None:
    """Leave without the interpreter's final garbage collection of the torch heap (seconds, during
    which frontend 0's stop waits for ``mpiexec``): finalize MPI as its atexit hook would, flush
    the logs, ``os._exit``. Frontend 0 leaves the same way (``executor.server_main.exit_now``)."""
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
