"""Experiment: HTTP frontends per server (the lattice's SO_REUSEPORT frontends), K = 1, 2, 4.

    .venv/bin/python bench/frontend_scaling.py [--num-prompts 600] [--conc 64] [--repeats 3]

One gen server serving a tiny random-weight Llama (so the engine is cheap and the HTTP/tokenizer
side is the bottleneck) is started with ``num_frontends`` K; ``pdserve bench`` sends short streamed
completions (16 prompt tokens, 4 output tokens, ignore-eos) at rate inf with ``--conc`` in flight.
Reports requests/s and TTFT p50/p99 per K (median of repeats; K alternates inside each repeat) and
writes the ``frontends`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (PY, RESULTS, Procs, bench, conditions, loadavg, md_table, median, say,  # noqa: E402
                      server_url, update_section, write_topology)

KS = (1, 2, 4)


def run_one(k: int, model_dir: Path, a: argparse.Namespace, procs: Procs) -> dict:
    topo = RESULTS / "frontends" / f"k{k}.yaml"
    doc = write_topology(topo, model_path=str(model_dir), model_name="tiny-llama",
                         engine={"num_frontends": k, "num_threads": 1, "num_kv_blocks": 1024, "max_batch_size": 64})
    url = server_url(doc, "gen")
    name = f"gen-k{k}"
    procs.start(name, [PY, "-m", "gen_worker", "--config", str(topo), "--log-dir", str(procs.log_dir)])
    try:
        procs.wait_http(name, url + "/health", 240)
        res = bench(["--base-url", url, "--model", "tiny-llama", "--workload", "random", "--input-len", "16",
                     "--output-len", "4", "--ignore-eos", "--num-prompts", str(a.num_prompts), "--request-rate", "inf",
                     "--max-concurrency", str(a.conc), "--num-warmups", "20", "--disable-tqdm", "--max-duration", "300"])
    finally:
        procs.stop(name)
    m = res["runs"][0]["metrics"]
    if m["failed"]:
        raise RuntimeError(f"K={k}: {m['failed']} requests failed")
    return {"rps": m["request_throughput"], "ttft50": m["ttft_ms"]["median"], "ttft99": m["ttft_ms"]["p99"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--conc", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    from engine.tiny import make_tiny_llama

    load0 = loadavg()
    runs: dict[int, list[dict]] = {k: [] for k in KS}
    with tempfile.TemporaryDirectory() as tmp, Procs(RESULTS / "frontends" / "logs") as procs:
        model_dir = make_tiny_llama(Path(tmp) / "tiny", seed=0)
        for rep in range(a.repeats):
            for k in (KS if rep % 2 == 0 else tuple(reversed(KS))):
                t0 = time.monotonic()
                runs[k].append(run_one(k, model_dir, a, procs))
                say(f"repeat {rep + 1}, K={k}: {runs[k][-1]} ({time.monotonic() - t0:.0f} s)")
    rows = []
    base = median([r["rps"] for r in runs[1]])
    for k in KS:
        rps = median([r["rps"] for r in runs[k]])
        rows.append([k, f"{rps:.1f}", f"{rps / base:.2f}×", f"{median([r['ttft50'] for r in runs[k]]):.1f}",
                     f"{median([r['ttft99'] for r in runs[k]]):.1f}"])
    table = md_table(["frontends K", "requests/s", "vs K=1", "TTFT p50 (ms)", "TTFT p99 (ms)"], rows)
    print(table)
    update_section("frontends", "\n".join([
        "## Frontends per server (executor lattice)", "",
        f"Command: `.venv/bin/python bench/frontend_scaling.py --num-prompts {a.num_prompts} --conc {a.conc} "
        f"--repeats {a.repeats}`", "",
        "One gen server, tiny random-weight Llama (engine cost ≈ 0), K HTTP frontends sharing the port "
        f"(SO_REUSEPORT); streamed completions of 16 → 4 tokens, rate inf, {a.conc} in flight; medians of "
        f"{a.repeats} repeats with K alternating.", "", conditions(load0), "", table, "",
    ]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
