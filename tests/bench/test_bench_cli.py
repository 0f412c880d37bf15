"""`pdserve bench` against a running tiny-model cluster (1 ctx + 1 gen + orchestrator on 127.0.0.1):
the terminal table, the JSON result and the PNG plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.procs import ROOT, Cluster, Procs, write_topology

PDSERVE = str(Path(sys.executable).parent / "pdserve")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir
    procs = Procs(tmp_path_factory.mktemp("logs"))
    topo = write_topology(tmp_path_factory.mktemp("topo") / "tiny.yaml", str(model), "tiny-llama",
                          engine={"executor": "inproc"}, kv_transfer={"backend": "tcp"})
    try:
        yield Cluster(topo, procs).start()
    finally:
        procs.stop_all()


def pdserve_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # PYTHONPATH: pdbench is importable from the source tree even before a reinstall lists it.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([PDSERVE, "bench", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_bench_sweep_writes_table_json_and_plots(cluster, tmp_path):
    res = pdserve_bench("--base-url", cluster.url, "--workload", "random", "--input-len", "16", "--output-len", "8",
                        "--ignore-eos", "--num-prompts", "12", "--request-rate", "50,inf", "--max-concurrency", "4",
                        "--vocab-size", "49152", "--goodput", "ttft:10000", "tpot:2000", "--save-result", "--plot",
                        "--result-dir", str(tmp_path), "--result-filename", "run.json", "--disable-tqdm")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    for needle in ("Successful requests:", "Request goodput (req/s):", "Mean TTFT (ms):", "P99 TPOT (ms):",
                   "Median ITL (ms):", "P90 E2EL (ms):", "Output token throughput (tok/s):", "TTFT p99"):
        assert needle in out, out
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["model"] == "tiny-llama" and [r["request_rate"] for r in doc["runs"]] == [50.0, "inf"]
    for run in doc["runs"]:
        m = run["metrics"]
        assert (m["completed"], m["failed"]) == (12, 0)
        assert m["total_output_tokens"] == 12 * 8 and m["total_input_tokens"] == 12 * 16  # ignore_eos, ids
        assert m["good_requests"] == 12 and m["slo_attainment"] == 1.0
        assert 0 < m["ttft_ms"]["median"] <= m["ttft_ms"]["p99"] <= m["e2el_ms"]["p99"]
        assert len(run["requests"]["ttfts_ms"]) == 12 and all(len(x) >= 1 for x in run["requests"]["itls_ms"])
    for name in ("run-cdf.png", "run-goodput.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_bench_chat_text_prefix_workload(cluster, tmp_path):
    res = pdserve_bench("--base-url", cluster.url, "--endpoint", "chat", "--prompt-format", "text",
                        "--workload", "prefix", "--prefix-len", "12", "--num-prefixes", "2", "--input-len", "4",
                        "--output-len", "4", "--num-prompts", "4", "--request-rate", "inf", "--save-result",
                        "--result-dir", str(tmp_path), "--result-filename", "chat.json", "--disable-tqdm")
    assert res.returncode == 0, res.stdout + res.stderr
    m = json.loads((tmp_path / "chat.json").read_text())["runs"][0]["metrics"]
    assert m["completed"] == 4 and m["total_input_tokens"] > 4 * 16  # chat template adds tokens


def test_bench_reports_unreachable_server(tmp_path):
    res = pdserve_bench("--base-url", "http://127.0.0.1:9", "--num-prompts", "2", "--disable-tqdm", timeout=60)
    assert res.returncode == 1 and "error:" in res.stderr


def test_bench_multiturn_through_the_orchestrator(cluster, tmp_path):
    """Turns in sequence, history sent back: from turn 2 on the ctx server's prefix cache holds the
    previous turn's prompt (block_size 4), so every later turn reports cached prompt tokens."""
    res = pdserve_bench("--base-url", cluster.url, "--endpoint", "chat", "--workload", "multiturn",
                        "--num-conversations", "2", "--num-turns", "3", "--input-len", "8", "--output-len", "4",
                        "--ignore-eos", "--max-concurrency", "2", "--num-warmups", "0", "--save-result",
                        "--result-dir", str(tmp_path), "--result-filename", "mt.json", "--disable-tqdm")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "turn 3 TTFT p50 / turn 1 TTFT p50:" in res.stdout and "Prefix cache hit rate (%):" in res.stdout
    run = json.loads((tmp_path / "mt.json").read_text())["runs"][0]
    assert run["metrics"]["completed"] == 6 and [t["completed"] for t in run["turns"]] == [2, 2, 2]
    req = run["requests"]
    assert req["conversation"] == [0, 0, 0, 1, 1, 1] and req["turn"] == [1, 2, 3, 1, 2, 3]
    for c in (0, 3):
        lens, cached = req["input_lens"][c:c + 3], req["cached_tokens"][c:c + 3]
        assert lens[0] < lens[1] < lens[2]                  # each turn carries the whole history
        for prev, hit in zip(lens, cached[1:]):
            assert hit >= (prev - 1) // 4 * 4 - 4, (lens, cached)   # previous prompt's blocks were a hit
    assert run["turns"][1]["prefix_hit_rate"] > 0.3


def test_bench_system_prompt_through_the_orchestrator(cluster, tmp_path):
    res = pdserve_bench("--base-url", cluster.url, "--workload", "system-prompt", "--prefix-len", "40",
                        "--input-len", "6", "--num-prefixes", "1", "--output-len", "2", "--num-prompts", "4",
                        "--max-concurrency", "1", "--vocab-size", "49152", "--extra-body",
                        '{"cache_salt": "system-prompt-test"}', "--save-result", "--result-dir", str(tmp_path),
                        "--result-filename", "sp.json", "--disable-tqdm")
    assert res.returncode == 0, res.stdout + res.stderr
    req = json.loads((tmp_path / "sp.json").read_text())["runs"][0]["requests"]
    assert req["input_lens"] == [46] * 4
    # The first request computes the shared 40 tokens (10 blocks of 4; the warm-up has its own prefix),
    # the others reuse them.
    assert req["cached_tokens"] == [0, 40, 40, 40]
