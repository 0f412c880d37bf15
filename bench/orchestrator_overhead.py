"""Experiment: what a router adds. The same near-free workers (``bench/fake_worker.py``) reached
directly, through the pdserve orchestrator, and through sglang-router in PD mode.

    .venv/bin/python bench/orchestrator_overhead.py [--sglang-python /tmp/peers-sgl/bin/python]

Two fake workers A and B answer at once (no model). Paths:

- **direct**: client → B (one plain streamed completion).
- **pdserve**: client → orchestrator → A (``context_only``, JSON answer) then → B
  (``generation_only``, streamed and relayed): two upstream calls in sequence, as every
  disaggregated request makes.
- **sglang-router** (``--pd-disaggregation``, prefill A, decode B): one request sent to A
  *and* B at once with ``bootstrap_host/port/room`` added; the client gets B's stream. (In SGLang
  the KV handoff then runs worker to worker; here nothing moves.)

Routers are pinned to core 1, workers and the load generator to core 0 (taskset); both routers use
round-robin. Latency: concurrency 1, ``--latency-prompts`` streamed requests of 16 tokens;
added latency = router's TTFT/E2EL minus direct. Throughput: rate inf, concurrency
``--conc``, the maximum requests/s the client measured. Targets alternate within each repeat; cells
are medians of ``--repeats``. Writes the ``overhead`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402

from _harness import (conditions, loadavg, FIGURES, PY, RESULTS, ROOT, Procs, bench, free_port, md_table, median, say,  # noqa: E402
                      update_section)


def start(procs: Procs, a: argparse.Namespace) -> dict[str, str]:
    tok_dir = RESULTS / "overhead" / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        from engine.model_files import resolve_model_path
        from engine.tokenizer import Tokenizer

        Tokenizer.from_model_path(Path(resolve_model_path("smollm2"))).hf.save_pretrained(str(tok_dir))
    pa, pb = free_port(), free_port()
    fw = str(ROOT / "bench" / "fake_worker.py")
    procs.start("worker_a", [PY, fw, "--port", str(pa), "--role", "prefill", "--tokenizer-dir", str(tok_dir)], cores="0")
    procs.start("worker_b", [PY, fw, "--port", str(pb), "--role", "decode", "--tokenizer-dir", str(tok_dir)], cores="0")
    a_url, b_url = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    procs.wait_http("worker_a", a_url + "/health", 30)
    procs.wait_http("worker_b", b_url + "/health", 30)
    urls = {"direct": b_url}
    procs.worker_urls = {"worker_a": a_url, "worker_b": b_url}
    port = free_port()
    topo = RESULTS / "overhead" / "pdserve.yaml"
    topo.parent.mkdir(parents=True, exist_ok=True)
    topo.write_text(yaml.safe_dump({
        "model": {"path": str(tok_dir), "name": "fake-model"},
        "orchestrator": {"host": "127.0.0.1", "port": port, "router": "round_robin", "health_interval_s": 1.0},
        "pools": {"ctx": {"servers": [{"host": "127.0.0.1", "port": pa}]},
                  "gen": {"servers": [{"host": "127.0.0.1", "port": pb}]}},
    }, sort_keys=False))
    procs.start("pdserve", [PY, "-m", "orchestrator", "--config", str(topo)], cores="1")
    urls["pdserve orchestrator"] = f"http://127.0.0.1:{port}"
    procs.wait_http("pdserve", urls["pdserve orchestrator"] + "/health", 60)
    if a.sglang_python and Path(a.sglang_python).exists():
        port, prom = free_port(), free_port()
        procs.start("sglang", [a.sglang_python, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                               "--prefill", a_url, str(free_port()), "--decode", b_url, "--policy", "round_robin",
                               "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
                               "--prometheus-port", str(prom), "--log-level", "warn"], cores="1")
        urls["sglang-router (PD)"] = f"http://127.0.0.1:{port}"
        procs.wait_http("sglang", urls["sglang-router (PD)"] + "/v1/models", 60)
        time.sleep(2.0)  # worker registration finishes in the background
    return urls


def run_one(url: str, argv: list[str]) -> dict:
    doc = bench(["--base-url", url, "--model", "fake-model", "--workload", "random", "--prompt-format", "text", "--input-len", "32",
                 "--output-len", "16", "--disable-tqdm", "--max-duration", "120", "--num-warmups", "5", *argv])
    m = doc["runs"][0]["metrics"]
    if m["failed"]:
        raise RuntimeError(f"{m['failed']} requests failed via {url}: {doc['runs'][0]['errors'][:3]}")
    return m


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang-python", default=None, help="python of a venv with sglang-router (skipped if absent)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-prompts", type=int, default=200)
    p.add_argument("--throughput-prompts", type=int, default=1500)
    p.add_argument("--conc", type=int, default=32)
    a = p.parse_args()
    t0 = time.monotonic()
    load0 = loadavg()
    lat: dict[str, list[dict]] = {}
    thr: dict[str, list[dict]] = {}
    calls: dict = {}
    with Procs(RESULTS / "overhead" / "logs") as procs:
        urls = start(procs, a)
        say(f"targets: {urls}")
        for rep in range(a.repeats):
            for name, url in urls.items():
                m = run_one(url, ["--num-prompts", str(a.latency_prompts), "--max-concurrency", "1", "--seed", str(rep)])
                lat.setdefault(name, []).append(m)
                m2 = run_one(url, ["--num-prompts", str(a.throughput_prompts), "--max-concurrency", str(a.conc),
                                   "--request-rate", "inf", "--seed", str(rep)])
                thr.setdefault(name, []).append(m2)
                say(f"repeat {rep} {name}: TTFT p50 {m['ttft_ms']['median']:.2f} ms, "
                    f"p99 {m['ttft_ms']['p99']:.2f} ms; max {m2['request_throughput']:.0f} req/s")
        import httpx

        for w, wurl in procs.worker_urls.items():
            calls[w] = httpx.get(f"{wurl}/stats", trust_env=False).json()
    (RESULTS / "overhead" / "results.json").write_text(json.dumps({"latency": lat, "throughput": thr,
                                                                    "worker_calls": calls}, indent=2))
    base_ttft50 = median([m["ttft_ms"]["median"] for m in lat["direct"]])
    base_ttft99 = median([m["ttft_ms"]["p99"] for m in lat["direct"]])
    base_e2e50 = median([m["e2el_ms"]["median"] for m in lat["direct"]])
    base_e2e99 = median([m["e2el_ms"]["p99"] for m in lat["direct"]])
    rows, summary = [], {}
    for name in lat:
        t50 = median([m["ttft_ms"]["median"] for m in lat[name]])
        t99 = median([m["ttft_ms"]["p99"] for m in lat[name]])
        e50 = median([m["e2el_ms"]["median"] for m in lat[name]])
        e99 = median([m["e2el_ms"]["p99"] for m in lat[name]])
        rps = median([m["request_throughput"] for m in thr[name]])
        summary[name] = (t50 - base_ttft50, t99 - base_ttft99, rps)
        rows.append([name, f"{t50:.2f}", f"{t99:.2f}", f"{t50 - base_ttft50:+.2f}", f"{t99 - base_ttft99:+.2f}",
                     f"{e50 - base_e2e50:+.2f}", f"{e99 - base_e2e99:+.2f}", f"{rps:.0f}",
                     " / ".join(f"{m['request_throughput']:.0f}" for m in thr[name])])
    table = md_table(["path", "TTFT p50 ms", "TTFT p99 ms", "added TTFT p50", "added TTFT p99", "added E2EL p50",
                      "added E2EL p99", "max req/s", "req/s runs"], rows)
    plot(summary, FIGURES / "orchestrator_overhead.png")
    direct_rps = summary["direct"][2]
    parts = [f"{n} adds {v[0]:+.1f} ms to TTFT at p50 ({v[1]:+.1f} ms at p99) and tops out at {v[2]:.0f} req/s "
             f"({v[2] / direct_rps:.2f}× direct)" for n, v in summary.items() if n != "direct"]
    reading = ("**Reading:** " + "; ".join(parts) + f". Direct tops out at {direct_rps:.0f} req/s, the ceiling of this "
               "setup (the Python load generator shares core 0 with the workers), so a router near that number is "
               "not the bottleneck here.")
    cmd = " ".join(["python bench/orchestrator_overhead.py"] + sys.argv[1:])
    body = f"""## Orchestrator overhead: direct vs pdserve orchestrator vs sglang-router (PD mode)

Command (took {(time.monotonic() - t0) / 60:.1f} min): `{cmd}`

{conditions(load0)}

The workers are `bench/fake_worker.py` (raw ASGI on uvicorn, answers at once, no model), so every
millisecond above *direct* is the router's. Routers pinned to core 1, workers and the load
generator to core 0. Requests: 32-word text prompts (sglang-router rejects token-id prompts on /v1/completions), 16 streamed output tokens. Latency at
concurrency 1 ({a.latency_prompts} requests per run); max req/s at concurrency {a.conc}, rate inf
({a.throughput_prompts} requests per run). Medians of {a.repeats} repeats, targets alternating.

What each router does per request (be fair when reading the numbers):
- **pdserve orchestrator** (Python, FastAPI/uvicorn, one process): validates the body, POSTs the
  context phase to A and waits for its JSON answer, then POSTs the generation phase to B and
  relays its SSE stream. Two upstream round trips in sequence — the cost of `context_first`.
- **sglang-router** (Rust, `--pd-disaggregation`): sends the request to A and B *at once* with
  `bootstrap_*` fields and relays B's stream; the prefill→decode handoff is the workers' business
  (over the bootstrap server), so the router's own critical path has one round trip.
- Worker calls counted by the fakes over the whole run: {json.dumps(calls)}.

{table}

![orchestrator overhead](figures/orchestrator_overhead.png)

{reading}
"""
    update_section("overhead", body)
    print(table)
    return 0


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    x = range(len(names))
    axes[0].bar([i - 0.2 for i in x], [summary[n][0] for n in names], 0.4, label="p50")
    axes[0].bar([i + 0.2 for i in x], [summary[n][1] for n in names], 0.4, label="p99")
    axes[0].set_ylabel("added TTFT vs direct (ms)")
    axes[0].legend(fontsize=8)
    axes[1].bar(list(x), [summary[n][2] for n in names], 0.5)
    axes[1].set_ylabel("max requests/s (client-measured)")
    for ax in axes:
        ax.set_xticks(list(x), names, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
