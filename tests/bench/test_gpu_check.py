"""bench/gpu_check.py runs on CPU with the tiny model, so it is tested before it meets a GPU host."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, *extra: str, timeout: int) -> list[dict]:
    argv = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--device", "cpu", "--shapes", "tiny", "--quick",
            "--work", str(tmp_path), *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"check"')]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines


def test_whole_check_on_cpu(tmp_path):
    """Every check of the device script once, in its order (one run: the script's start-up, the
    model build and the HF reference are paid once, not once per subset)."""
    lines = _run(tmp_path, timeout=600)
    by: dict[str, list[dict]] = {}
    for line in lines:
        by.setdefault(line["check"], []).append(line)
    assert [line["check"] for line in lines] == ["probe", "engine_vs_hf", "throughput", "throughput", "disagg",
                                                 "kv_pull", "summary"], [line["check"] for line in lines]
    assert by["probe"][0]["device"] == "cpu"
    assert by["engine_vs_hf"][0]["match"] is True and by["engine_vs_hf"][0]["prompts"] == 5
    assert [r["concurrency"] for r in by["throughput"]] == [1, 4]
    assert all(r["engine_tok_s"] > 0 and r["hf_generate_tok_s"] > 0 for r in by["throughput"])
    assert by["disagg"][0]["match"] is True and by["disagg"][0]["kv_backend"] == "tcp"
    kv = by["kv_pull"][0]
    assert kv["data_ok"] is True and kv["bytes"] == 16 << 20
    assert kv["pull_gb_s"] > 0 and kv["copy_gb_s"] > 0
    assert by["summary"][0]["ok"] is True
