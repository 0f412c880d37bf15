"""``pdserve config check`` and argument errors of ``pdserve up``."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from orchestrator.cli import curl_line, main
from pdserve.config import load_topology, parse_topology

LOCAL = Path(__file__).resolve().parents[2] / "configs" / "local.yaml"


def test_config_check_prints_resolved_topology(capsys):
    assert main(["config", "check", str(LOCAL)]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert parse_topology(printed) == load_topology(LOCAL)  # the output is itself a valid topology
    assert "#   ctx[0] http://127.0.0.1:8001 engine:" in out


@pytest.mark.parametrize("text,path", [
    ("pools:\n  ctx: {servers: [{port: 8001}]}\n  gen: {servers: [{port: 8002}]}\norchestrator: {prot: 1}\n",
     "orchestrator.prot: unknown key"),
    ("pools:\n  ctx: {servers: [{port: 8001}]}\n  gen: {servers: [{port: high}]}\n",
     "pools.gen.servers.0.port: Input should be a valid integer"),
    ("engine: {block_size: -4}\npools:\n  ctx: {servers: [{port: 8001}]}\n  gen: {servers: [{port: 8002}]}\n",
     "engine.block_size: Input should be greater than or equal to 1"),
])
def test_config_check_names_the_bad_path(tmp_path, capsys, text, path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    assert main(["config", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    assert path in err and str(bad) in err


def test_config_check_missing_file(tmp_path, capsys):
    assert main(["config", "check", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read topology file" in capsys.readouterr().err


def test_up_with_bad_config_exits_1(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools: 3\n")
    assert main(["up", str(bad), "--log-dir", str(tmp_path / "logs")]) == 1
    assert "pools" in capsys.readouterr().err


def test_curl_line_names_model_and_url():
    line = curl_line(load_topology(LOCAL), "http://127.0.0.1:8000")
    assert line.startswith("curl http://127.0.0.1:8000/v1/chat/completions")
    assert '"model": "SmolLM2-135M-Instruct"' in line
    assert "Authorization" not in line  # no API key configured


def test_curl_line_sends_the_api_key_when_one_is_configured():
    base = load_topology(LOCAL)
    orch = base.orchestrator.model_copy(update={"api_key_env": "MY_PDSERVE_KEY"})
    topology = base.model_copy(update={"orchestrator": orch})
    line = curl_line(topology, "http://127.0.0.1:8000")
    assert '-H "Authorization: Bearer $MY_PDSERVE_KEY"' in line  # the shell expands it, the secret is not printed


@pytest.mark.parametrize("flag", [False, True])
def test_up_writes_logs_where_the_file_or_the_flag_says(tmp_path, monkeypatch, flag):
    """``launcher.log_dir`` of the file is where ``pdserve up`` logs unless ``--log-dir`` is given."""
    import orchestrator.cli as cli
    from pdserve.config import TopologyError

    file_dir, flag_dir = tmp_path / "from_file", tmp_path / "from_flag"
    cfg = yaml.safe_load(LOCAL.read_text())
    cfg["launcher"]["log_dir"] = str(file_dir)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(cfg))
    seen = {}

    class Refuse:  # records where the launcher would log, then stops cmd_up before any process
        def __init__(self, config, *, topology, log_dir):
            seen["log_dir"] = Path(log_dir)
            raise TopologyError("stop here")

    monkeypatch.setattr(cli, "LocalLauncher", Refuse)
    monkeypatch.setenv("PDSERVE_ADMIN_TOKEN", "x")
    monkeypatch.delenv("PDSERVE_ADMIN_TOKEN")
    monkeypatch.setenv("PDSERVE_LOG_DIR", "unset")
    argv = ["up", str(path)] + (["--log-dir", str(flag_dir)] if flag else [])
    assert main(argv) == 1
    want = flag_dir if flag else file_dir
    assert seen["log_dir"] == want
    assert (want / "admin_token").is_file()


@pytest.mark.parametrize("where", ["orchestrator", "ctx", "gen"])
def test_unset_api_key_variable_is_a_config_error_exit_2(tmp_path, capsys, monkeypatch, where):
    """An ``api_key_env`` naming an unset variable: a one-line error and status 2 (bad configuration)
    from the orchestrator and from each server, before anything starts; not a traceback."""
    import executor.server_main
    import orchestrator.__main__

    monkeypatch.delenv("T_UNSET_KEY_VAR", raising=False)
    topo = yaml.safe_load(LOCAL.read_text())
    section = topo["orchestrator"] if where == "orchestrator" else topo["pools"][where]
    section["api_key_env"] = "T_UNSET_KEY_VAR"
    path = tmp_path / "keyed.yaml"
    path.write_text(yaml.safe_dump(topo))
    assert orchestrator.__main__.main(["--config", str(path)]) == 2
    assert "T_UNSET_KEY_VAR" in capsys.readouterr().err
    if where != "orchestrator":
        assert executor.server_main.main(where, ["--config", str(path), "--index", "0"]) == 2
        assert "T_UNSET_KEY_VAR" in capsys.readouterr().err
