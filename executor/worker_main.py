"""Entry point of one worker rank: ``mpiexec -n TP python -m executor.worker_main --ipc-dir DIR``.

Start-up handshake with the server's proxy (frontend 0), over a DEALER → ROUTER socket:
1. every rank sends ``("hello", rank, pid, start_time)`` as soon as MPI is up, so the proxy knows
   the pids even of ranks that later fail;
2. each rank loads its engine shard; a failure sends ``("failed", rank, cause)`` and exits 1;
3. rank 0 binds the ingress, every rank sends ``("ready", rank, info)``;
4. each rank waits for ``("ack",)`` (bounded) and only then serves: the proxy attaches its death
   callbacks after acking, so a rank that dies during start-up takes the start-up failure path.

The launch spec (``spec.json``: the server config, the worker-role plugin, socket addresses) and
the HMAC key (``key``) are files in the private IPC directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback
from pathlib import Path

import zmq

from executor.ipc import Codec
from executor.monitor import proc_start_time

log = logging.getLogger("pdserve.worker")

ACK_TIMEOUT_MS = 60_000
CRASH_ENV = "PDSERVE_TEST_CRASH_RANK"  # tests: make this rank fail during start-up


def _handshake_socket(zctx: zmq.Context, addr: str, rank: int) -> zmq.Socket:
    sock = zctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(addr)
    return sock


def build_worker(spec: dict, rank: int, size: int):
    """Load the engine (this rank's shard) and the worker role. Returns (engine, role, info)."""
    from engine.llm_engine import LLMEngine
    from executor.server_main import engine_config, kv_layout, load_plugin
    from pdserve.config import ServerConfig

    if os.environ.get(CRASH_ENV) == str(rank):
        raise RuntimeError(f"injected start-up crash ({CRASH_ENV}={rank})")
    cfg = ServerConfig.model_validate(spec["server"])
    engine = LLMEngine(engine_config(cfg))
    layout = kv_layout(cfg, engine)
    role = load_plugin(spec["role_plugin"])(cfg, layout)
    mc = engine.model_config
    info = {"max_model_len": engine.max_model_len, "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids), "kv_layout": layout.model_dump(),
            "model_path": str(spec["server"]["model"]["path"])}
    return engine, role, info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m executor.worker_main")
    p.add_argument("--ipc-dir", required=True)
    args = p.parse_args(argv)
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    ipc = Path(args.ipc_dir)
    spec = json.loads((ipc / "spec.json").read_text())
    codec = Codec((ipc / "key").read_bytes())
    zctx = zmq.Context()
    hs = _handshake_socket(zctx, spec["ready_addr"], rank)
    pid = os.getpid()
    hs.send(codec.encode(("hello", rank, pid, proc_start_time(pid))))
    try:
        engine, role, info = build_worker(spec, rank, size)
        loop = None
        if rank == 0:
            from executor.worker_loop import WorkerLoop

            loop = WorkerLoop(engine, role, codec, spec["ingress_addr"], spec["lane_addrs"])
    except Exception as err:  # noqa: BLE001 - reported to the proxy, then the rank exits
        cause = f"{type(err).__name__}: {err}"
        log.error("start-up failed: %s\n%s", cause, traceback.format_exc())
        hs.send(codec.encode(("failed", rank, cause)))
        hs.close()
        return 1
    hs.send(codec.encode(("ready", rank, info)))
    if not hs.poll(ACK_TIMEOUT_MS):
        log.error("no ack from the proxy within %d ms; exiting", ACK_TIMEOUT_MS)
        return 1
    codec.decode(hs.recv())
    if loop is None:
        log.error("tensor parallel follower ranks are not supported by this build")
        return 1
    log.info("serving")
    try:
        loop.run()
    except Exception as err:  # noqa: BLE001 - the engine is dead: tell the frontends, exit non-zero
        log.exception("worker loop failed")
        loop.broadcast_dead(f"worker rank {rank} failed: {type(err).__name__}: {err}")
        return 1
    finally:
        loop.close()
        hs.close()
        zctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
