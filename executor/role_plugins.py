"""The role plugins table: which module of ``ctx_worker`` / ``gen_worker`` plugs into the executor.

A leaf (standard library only), so that the proxy can name the worker side of a role and launch
the ranks before the frontend has imported torch and the HTTP stack (:mod:`executor.server_main`
starts the ranks first, so their start-up overlaps the frontend's imports).

Each role names two plugins by import path, so that the executor never imports the role
packages (arrows point ctx_worker/gen_worker -> executor): the worker side (next to the engine:
KV parking, serving, pulling) and the frontend side (phase handlers and routes).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

ROLE_PLUGINS: dict[str, tuple[str, str]] = {
    "ctx": ("ctx_worker.kv_role:make_worker_role", "ctx_worker.context_phase:setup_ctx_frontend"),
    "gen": ("gen_worker.kv_role:make_worker_role", "gen_worker.generation_phase:setup_gen_frontend"),
}


def worker_plugin(role: str) -> str:
    """Import path of the worker side of ``role`` ("ctx" or "gen"). Raises KeyError."""
    return ROLE_PLUGINS[role][0]


def frontend_plugin(role: str) -> str:
    """Import path of the frontend side of ``role`` ("ctx" or "gen"). Raises KeyError."""
    return ROLE_PLUGINS[role][1]


def load_plugin(path: str) -> Callable:
    """Import ``module:attribute``. Raises ImportError / AttributeError."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)
