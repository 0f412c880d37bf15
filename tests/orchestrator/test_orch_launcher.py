"""LocalLauncher with fake server processes and the real orchestrator process."""

from __future__ import annotations

import io
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from orch_fakes import MODEL, bind_socket, text_of
from orchestrator.launcher import LaunchError, LocalLauncher
from pdserve.config import load_topology

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FAKE = HERE / "orch_fake_proc.py"


def free_ports(n: int) -> list[int]:
    socks = [bind_socket() for _ in range(n)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def config(tmp_path) -> Path:
    orch, ctx, gen = free_ports(3)
    data = {"model": {"name": MODEL},
            "orchestrator": {"port": orch, "health_interval_s": 0.1, "startup_timeout_s": 30},
            "pools": {"ctx": {"servers": [{"port": ctx}]}, "gen": {"servers": [{"port": gen}]}}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def make_launcher(config: Path, tmp_path: Path, overrides: dict | None = None) -> LocalLauncher:
    """Fake ctx/gen processes; ``overrides[(role, index)]`` replaces a child's argv."""
    topology = load_topology(config)

    def command(role: str, index: int | None) -> list[str]:
        if (role, index) in (overrides or {}):
            return overrides[(role, index)]
        if role == "orchestrator":
            return [sys.executable, "-m", "orchestrator", "--config", str(config)]
        port = getattr(topology.pools, role).servers[index].port
        return [sys.executable, str(FAKE), "--role", role, "--port", str(port)]

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)])}
    return LocalLauncher(config, topology=topology, log_dir=tmp_path / "logs", command=command, env=env,
                         cwd=REPO, out=io.StringIO(), grace_s=5.0)


def test_up_serves_and_stop_ends_every_child(config, tmp_path):
    launcher = make_launcher(config, tmp_path)
    with launcher:
        r = httpx.post(launcher.url + "/v1/chat/completions", timeout=10,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.json()["choices"][0]["message"]["content"] == text_of(3)
        pids = launcher.pids()
        assert set(pids) == {"ctx[0]", "gen[0]", "orchestrator"}
    codes = launcher.stop()
    assert all(code is not None for code in codes.values()), codes
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    progress = launcher._out.getvalue()
    assert f"starting ctx[0] on 127.0.0.1:{launcher.topology.pools.ctx.servers[0].port}" in progress
    assert (tmp_path / "logs" / "orchestrator.log").exists()


def test_child_exiting_early_is_named_with_code_and_log(config, tmp_path):
    bad = [sys.executable, str(FAKE), "--role", "ctx", "--port", "1", "--exit-code", "3"]
    launcher = make_launcher(config, tmp_path, {("ctx", 0): bad})
    with pytest.raises(LaunchError) as exc:
        launcher.up(timeout_s=20)
    msg = str(exc.value)
    assert "ctx[0]" in msg and "exit code 3" in msg
    assert str(tmp_path / "logs" / "ctx0.log") in msg and "boom, exiting with 3" in msg
    assert all(code is not None for code in launcher.stop().values())


def test_child_not_ready_in_time_is_named(config, tmp_path):
    sleeper = [sys.executable, "-c", "import time; print('loading forever', flush=True); time.sleep(60)"]
    launcher = make_launcher(config, tmp_path, {("gen", 0): sleeper})
    with pytest.raises(LaunchError) as exc:
        launcher.up(timeout_s=3)
    msg = str(exc.value)
    assert "gen[0]" in msg and "did not become ready within 3 s" in msg and "still running" in msg
    assert "loading forever" in msg
    assert all(code is not None for code in launcher.stop().values())


def test_child_death_while_serving_is_reported(config, tmp_path):
    launcher = make_launcher(config, tmp_path)
    with launcher:
        os.kill(launcher.pids()["gen[0]"], signal.SIGKILL)
        with pytest.raises(LaunchError) as exc:
            launcher.serve_forever(poll_s=0.05)
        assert "gen[0]" in str(exc.value) and "exit code -9" in str(exc.value)
