"""Start one ctx or gen server from a topology file: ``python -m ctx_worker --config FILE --index N``.

Order matters: the engine (weights, tokenizer, KV cache) is loaded *before* the HTTP port opens, so
a server that accepts connections is ready to serve and ``/health`` is never 200 for a half-built
server.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections.abc import Callable

import uvicorn

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from executor.http_server import ServerState, create_server_app
from executor.inproc_executor import InProcessExecutor
from executor.kv_role import WorkerRole
from executor.metrics import RoleStatsCollector, ServerMetrics
from executor.phases import ColocatedPhase
from pdserve.config import Role, ServerConfig, TopologyError, load_topology
from pdserve.protocol import KVLayoutModel

log = logging.getLogger("pdserve.server")

# Each role names two plugins by import path, so that the executor never imports the role
# packages (arrows point ctx_worker/gen_worker -> executor): the worker side (next to the engine:
# KV parking, serving, pulling) and the frontend side (phase handlers and routes).
ROLE_PLUGINS: dict[str, tuple[str, str]] = {
    "ctx": ("ctx_worker.kv_role:make_worker_role", "ctx_worker.context_phase:setup_ctx_frontend"),
    "gen": ("gen_worker.kv_role:make_worker_role", "gen_worker.generation_phase:setup_gen_frontend"),
}


def load_plugin(path: str) -> Callable:
    """Import ``module:attribute``."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_config(cfg: ServerConfig) -> EngineConfig:
    """Map the topology's engine settings onto the engine's own config."""
    e = cfg.engine
    return EngineConfig(model=cfg.model.path, dtype=e.dtype, block_size=e.block_size, num_kv_blocks=e.num_kv_blocks,
                        max_batch_size=e.max_batch_size, max_num_tokens=e.max_num_tokens,
                        max_model_len=e.max_model_len, num_threads=e.num_threads)


def kv_layout(cfg: ServerConfig, engine: LLMEngine) -> KVLayoutModel:
    """This server's KV layout (single rank: tp_rank 0 of 1)."""
    mc = engine.model_config
    return KVLayoutModel(model=cfg.model.name, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                         head_dim=mc.head_dim, block_size=cfg.engine.block_size, dtype=cfg.engine.dtype)


def build_state(cfg: ServerConfig) -> ServerState:
    """Load the engine, start its loop and wire the role in. Raises whatever loading raises."""
    t0 = time.perf_counter()
    log.info("%s[%d]: loading %s (%s, %d KV blocks of %d tokens)", cfg.role, cfg.index, cfg.model.path,
             cfg.engine.dtype, cfg.engine.num_kv_blocks, cfg.engine.block_size)
    engine = LLMEngine(engine_config(cfg))
    log.info("%s[%d]: engine ready in %.1f s (context window %d tokens)", cfg.role, cfg.index,
             time.perf_counter() - t0, engine.max_model_len)
    make_role, setup_frontend = (load_plugin(p) for p in ROLE_PLUGINS[cfg.role])
    layout = kv_layout(cfg, engine)
    role: WorkerRole = make_role(cfg, layout)
    executor = InProcessExecutor(engine, role)
    metrics = ServerMetrics(cfg.role, cfg.kv_transfer.backend)
    metrics.registry.register(RoleStatsCollector(executor.stats))
    state = ServerState(config=cfg, client=executor, handlers={"context_and_generation": ColocatedPhase(executor)},
                        metrics=metrics, kv_layout=layout, kv_backend=cfg.kv_transfer.backend,
                        vocab_size=engine.model_config.vocab_size)
    state.on_shutdown.append(executor.shutdown)
    setup_frontend(state)
    executor.start()
    return state


def parse_args(role: Role, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {role}_worker", description=f"Run one pdserve {role} server.")
    p.add_argument("--config", required=True, help="topology YAML file")
    p.add_argument("--index", type=int, default=0, help=f"which server of pools.{role}.servers (default 0)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p.parse_args(argv)


def main(role: Role, argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ctx_worker`` / ``python -m gen_worker``. Returns the exit code."""
    args = parse_args(role, argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s {role}[{args.index}] %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_topology(args.config).server_config(role, args.index)
    except (TopologyError, IndexError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    state = build_state(cfg)
    app = create_server_app(state)
    log.info("%s[%d]: serving on http://%s:%d", role, cfg.index, cfg.host, cfg.port)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", timeout_graceful_shutdown=5)
    return 0
