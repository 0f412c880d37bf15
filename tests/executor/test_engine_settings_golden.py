"""The engine settings every topology resolves to, and what reaches the engine, stay as they were.

``engine_settings_golden.json`` was written by this module's ``snapshot()`` on main (at 821caf3;
again at e0015ca, which added ``EngineConfig.pack_cpu_linears``), before the three engine
configuration classes (``EngineSettings``, ``EngineOverrides``, ``EngineConfig``) became one: for
every file in ``configs/`` and a few documents with pool overrides, each pool's resolved
settings, each listed server's resolved settings (device and dtype resolved as a server on an
AVX2 CPU without a GPU does), and the values the engine is built with. Regenerate only for an
intended change: ``python tests/executor/test_engine_settings_golden.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("engine_settings_golden.json")
AVX2 = frozenset({"avx", "avx2", "fma"})
POOLS = {"ctx": {"servers": [{"port": 8001}]}, "gen": {"servers": [{"port": 8002}]}}
# Documents beside configs/: pool overrides (a null override inherits), pinned dtypes, defaults.
DOCS = {
    "defaults": {"pools": POOLS},
    "overrides": {"model": {"path": "/m", "name": "served"},
                  "engine": {"num_threads": 2, "tp_size": 1, "num_kv_blocks": 512, "max_model_len": 4096},
                  "pools": {"ctx": {"servers": [{"port": 8001}, {"port": 8003}],
                                    "engine": {"tp_size": 2, "enable_prefix_caching": False, "num_frontends": 2}},
                            "gen": {"servers": [{"port": 8002}],
                                    "engine": {"num_threads": None, "max_batch_size": 8, "device": "cpu", "executor": "inproc",
                                               "num_kv_blocks": 64, "step_timeout_s": 30.0}}}},
    "pinned_dtype": {"engine": {"dtype": "bfloat16", "block_size": 32},
                     "pools": {"ctx": {**POOLS["ctx"], "engine": {"dtype": "float32"}},
                               "gen": {**POOLS["gen"], "engine": {"dtype": "float32", "gpu_memory_utilization": 0.4}}}},
}


def engine_view(cfg) -> dict:
    """What the engine of server ``cfg`` (resolved) is built with, as a flat dict: its settings'
    fields and LLMEngine's other arguments (on main: the fields of ``EngineConfig``)."""
    from tests.executor.engine_args import engine_args

    args = engine_args(cfg)
    settings = args.pop("config")
    assert settings is cfg.engine, "the server's settings reach the engine whole, not copied"
    del args["tp"]
    return {**settings.model_dump(mode="json"), **args}


def server_view(topology, role: str, index: int) -> dict:
    cfg = topology.server_config(role, index).with_resolved_device(0).with_resolved_dtype(AVX2, "cpu")
    return {"settings": cfg.engine.model_dump(mode="json"), "engine": engine_view(cfg)}


def topology_view(topology) -> dict:
    out: dict = {"pool_engine": {role: topology.pool_engine(role).model_dump(mode="json") for role in ("ctx", "gen")}}
    for role in ("ctx", "gen"):
        for i in range(len(topology.pool(role).servers)):
            out[f"{role}[{i}]"] = server_view(topology, role, i)
    return out


def snapshot() -> dict:
    from pdserve.config import load_topology, parse_topology

    views = {f"configs/{p.name}": topology_view(load_topology(p)) for p in sorted((ROOT / "configs").glob("*.yaml"))}
    views.update({name: topology_view(parse_topology(doc, name)) for name, doc in DOCS.items()})
    return views


def as_in(got, want):
    """``got`` cut to the keys of ``want``, recursively: a key added since the golden file was
    written is not compared, a key gone reads ``<missing>``."""
    if isinstance(want, dict) and isinstance(got, dict):
        return {k: as_in(got.get(k, "<missing>"), v) for k, v in want.items()}
    return got


def test_resolved_engine_settings_match_the_golden_file():
    golden = json.loads(GOLDEN.read_text())
    now = snapshot()
    assert sorted(now) == sorted(golden), "a configs/ file was added or removed: regenerate the golden file"
    for source, view in golden.items():
        assert as_in(now[source], view) == view, source


def test_the_golden_file_covers_overrides():
    """The documents above do reach the pool overrides (so the comparison can fail on them)."""
    golden = json.loads(GOLDEN.read_text())["overrides"]
    assert golden["pool_engine"]["ctx"]["tp_size"] == 2 and golden["pool_engine"]["gen"]["tp_size"] == 1
    assert golden["pool_engine"]["gen"]["num_threads"] == 2  # null in a pool inherits
    assert golden["ctx[1]"]["engine"]["enable_prefix_caching"] is False
    assert golden["gen[0]"]["engine"]["num_kv_blocks"] == 64 and golden["ctx[0]"]["engine"]["num_kv_blocks"] == 512


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    GOLDEN.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
