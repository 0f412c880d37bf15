"""Topology schema: inheritance, path-naming errors, every file in configs/ passes `config check`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli import main
from pdserve.config import TopologyError, parse_topology

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
POOLS = {"ctx": {"servers": [{"port": 8001}]}, "gen": {"servers": [{"port": 8002}]}}


def test_every_config_file_passes_check(capsys):
    assert {p.name for p in CONFIGS} >= {"local.yaml", "tp2.yaml", "slurm-multinode.yaml"}
    for path in CONFIGS:
        assert main(["config", "check", str(path)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("doc,message", [
    ({"engine": {"blok_size": 4}, "pools": POOLS}, "engine.blok_size: unknown key"),
    ({"pools": {**POOLS, "gen": {"servers": [{"port": 8002}], "max_restarts": "many"}}},
     "pools.gen.max_restarts: Input should be a valid integer"),
    ({"pools": {**POOLS, "gen": {"servers": [{"port": 8002}], "engine": {"block_size": 32}}}},
     "pools.gen.engine.block_size: ctx resolves to 16 and gen to 32"),
    ({"pools": {**POOLS, "ctx": {"servers": [{"port": 8001}], "router": "random"}}}, "pools.ctx.router"),
    ({"pools": {**POOLS, "ctx": {"min_instances": 3, "max_instances": 2}}}, "pools.ctx"),
    ({"launcher": {"kind": "k8s"}, "pools": POOLS}, "launcher.kind"),
    ({"pools": {"ctx": {"servers": [{"port": 0}]}, "gen": POOLS["gen"]}}, "pools.ctx.servers.0.port: 0"),
])
def test_errors_name_the_path(doc, message):
    with pytest.raises(TopologyError) as err:
        parse_topology(doc)
    assert message in str(err.value)


def test_missing_model_names_model_path(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps({"model": {"path": str(tmp_path / "nope.gguf")}, "pools": POOLS}))
    assert main(["config", "check", str(path)]) == 1
    assert "model.path: " in capsys.readouterr().err
    assert main(["config", "check", "--no-files", str(path)]) == 0


def test_pool_overrides_and_router_inherit():
    t = parse_topology({"engine": {"num_threads": 2, "tp_size": 1}, "orchestrator": {"router": "least_loaded"},
                        "pools": {"ctx": {"servers": [{"port": 8001}], "engine": {"tp_size": 2}, "router": "kv_cache_aware"},
                                  "gen": {"servers": [{"port": 8002}]}}})
    assert t.pool_engine("ctx").tp_size == 2 and t.pool_engine("gen").tp_size == 1
    assert t.pool_engine("gen").num_threads == 2
    assert t.pool_router("ctx") == "kv_cache_aware" and t.pool_router("gen") == "least_loaded"
    extra = t.server_config("gen", 5, port=0)  # a scaled instance past the listed servers
    assert extra.index == 5 and extra.port == 0 and extra.orchestrator_url == "http://127.0.0.1:8000"
    with pytest.raises(IndexError):
        t.server_config("gen", 5)


def test_config_schema_is_json(capsys):
    assert main(["config", "schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert "launcher" in schema["properties"] and "LauncherSettings" in schema["$defs"]


def test_orchestrator_never_imports_torch():
    code = ("import sys, orchestrator.app, orchestrator.cli, orchestrator.backends, orchestrator.control, "
            "orchestrator.prompt_tokens, orchestrator.slurm_plan; "
            "bad = [m for m in ('torch', 'transformers', 'engine') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
