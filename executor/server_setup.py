"""What every process of one server builds from its :class:`ServerConfig` (a leaf of the executor).

The engine of one rank (built from the server's engine settings as they are), the KV layout of
each TP rank, and the HTTP state of one frontend (its role plugin from :mod:`executor.role_plugins`). Frontend 0
(``executor.server_main``), attached frontends (``executor.frontends``), the proxy and the worker
ranks (``executor.worker_main``) all import these from here, so none of them imports another's
entry point (no import circle; ``tests/executor/test_import_graph.py`` checks).
"""

from __future__ import annotations

from engine.structured_output import GrammarCompiler
from executor.http_server import ServerState
from executor.metrics import RoleStatsCollector, ServerMetrics
from executor.phases import ColocatedPhase
from executor.role_plugins import frontend_plugin, load_plugin
from pdserve.config import ServerConfig
from pdserve.protocol import KVLayoutModel


def make_engine(cfg: ServerConfig, tp=None, *, device: str | None = None, kv_cache_file: str | None = None):
    """Load the engine of one rank of server ``cfg``: ``cfg.engine`` passed whole (dtype and device
    resolved, else ValueError), the weights of ``model.path``, blocks named by ``model.name``.

    tp: the rank's engine.tp.TPContext (None: one rank). device: this rank's device where it is
    not ``cfg.engine.device`` (TP rank r on ``cuda:N+r``). kv_cache_file: the shared-memory file
    that backs a TP follower's KV cache. Raises what ``engine.LLMEngine`` raises.
    """
    from engine.llm_engine import LLMEngine

    settings = cfg.engine if device is None else cfg.engine.model_copy(update={"device": device})
    return LLMEngine(settings, cfg.model.path, tp, served_model_name=cfg.model.name, kv_cache_file=kv_cache_file)


def kv_layout(cfg: ServerConfig, engine, tp_rank: int = 0, tp_size: int = 1) -> KVLayoutModel:
    """The KV layout of TP rank ``tp_rank`` of ``tp_size`` (its share of the KV heads)."""
    from engine.tp import kv_head_range

    mc = engine.model_config
    lo, hi = kv_head_range(mc.num_kv_heads, tp_rank, tp_size)
    return KVLayoutModel(model=cfg.model.name, num_layers=mc.num_layers, num_kv_heads=hi - lo,
                         head_dim=mc.head_dim, block_size=cfg.engine.block_size, dtype=cfg.engine.dtype,
                         tp_rank=tp_rank, tp_size=tp_size)


def make_state(cfg: ServerConfig, client, layout: KVLayoutModel, vocab_size: int,
               layouts: list[KVLayoutModel] | None = None) -> ServerState:
    """The HTTP state of one frontend, with the role's handlers and routes added."""
    from executor.admin_routes import admin_router
    from executor.tokenize_routes import tokenize_router
    from executor.kv_event_routes import kv_event_router
    from kv_transfer.factory import resolve_backend

    # a CUDA KV cache is always served over CUDA IPC (kv_transfer.factory.make_kv_server)
    backend = "cudaipc" if cfg.engine.device != "cpu" else resolve_backend(cfg.kv_transfer.backend)
    metrics = ServerMetrics(cfg.role, backend)
    metrics.role_stats = RoleStatsCollector(client.stats)
    metrics.registry.register(metrics.role_stats)
    state = ServerState(config=cfg, client=client, handlers={"context_and_generation": ColocatedPhase(client)},
                        metrics=metrics, kv_layout=layout, kv_backend=backend, vocab_size=vocab_size,
                        kv_layouts=list(layouts or [layout]),
                        grammars=GrammarCompiler(client.tokenizer, vocab_size, client.tokenizer.eos_token_ids))
    load_plugin(frontend_plugin(cfg.role))(state)
    state.routers.append(admin_router(state))  # every frontend: /tokenizer, /admin/drain, /reset_prefix_cache
    state.routers.append(tokenize_router(state))  # /tokenize, /detokenize, /v1/models/{id}, /version
    if client.kv_events is not None:  # every frontend: GET /kv_events (stream), /kv_events/snapshot
        state.routers.append(kv_event_router(client))
    return state
