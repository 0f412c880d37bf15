"""Experiment: disaggregated (1 ctx + 1 gen, one core each) vs colocated (one server, both cores)
on the same two cores, under a mixed workload where long prompts arrive while short requests
decode — the prefill/decode interference experiment of DistServe, on CPU with SmolLM2.

    .venv/bin/python bench/disagg_vs_colocated.py [--rates 0.25,0.5,1] [--repeats 2]

- colocated: one ``ctx_worker`` server, ``engine.num_threads 2``, pinned to cores 0,1 (taskset);
  requests go to it directly and run both phases there (no ``disaggregated_params``).
- disaggregated: ctx server pinned to core 0, gen server pinned to core 1, ``num_threads 1``
  each, KV over the TCP transceiver; requests go through the pdserve orchestrator (unpinned).
- workload: ``pdserve bench --workload mixed``: a fraction of long prompts (few output tokens)
  among short prompts with longer outputs, Poisson arrivals at each rate of ``--rates``.

Both layouts stay up for the whole run; each (repeat, rate) runs colocated then disaggregated,
so the ratios come from runs minutes apart. Cells are medians over ``--repeats``. Writes the
``disagg`` section of docs/benchmarks.md and docs/figures/disagg_vs_colocated*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (conditions, loadavg, FIGURES, PY, RESULTS, Procs, bench, machine_description, md_table, median,  # noqa: E402
                      orchestrator_url, say, server_url, update_section, write_topology)

from pdbench.report import fmt_rate, rate_axis  # noqa: E402

LAYOUTS = ("colocated", "disaggregated")


def start_layouts(procs: Procs, a: argparse.Namespace) -> dict[str, str]:
    """Start both layouts; return their client URLs."""
    base = {"dtype": a.dtype, "num_kv_blocks": 512, "max_batch_size": 16, "max_num_tokens": 2048}
    colo = write_topology(RESULTS / "disagg" / "colocated.yaml", engine={**base, "num_threads": 2})
    dis = write_topology(RESULTS / "disagg" / "disaggregated.yaml", engine={**base, "num_threads": 1})
    colo_cfg, dis_cfg = str(RESULTS / "disagg" / "colocated.yaml"), str(RESULTS / "disagg" / "disaggregated.yaml")
    procs.start("colocated", [PY, "-m", "ctx_worker", "--config", colo_cfg, "--index", "0"], cores="0,1")
    procs.start("ctx", [PY, "-m", "ctx_worker", "--config", dis_cfg, "--index", "0"], cores="0")
    procs.start("gen", [PY, "-m", "gen_worker", "--config", dis_cfg, "--index", "0"], cores="1")
    procs.start("orchestrator", [PY, "-m", "orchestrator", "--config", dis_cfg])
    procs.wait_http("colocated", server_url(colo, "ctx") + "/health", 300)
    procs.wait_http("ctx", server_url(dis, "ctx") + "/health", 300)
    procs.wait_http("gen", server_url(dis, "gen") + "/health", 300)
    procs.wait_http("orchestrator", orchestrator_url(dis) + "/health", 300)
    return {"colocated": server_url(colo, "ctx"), "disaggregated": orchestrator_url(dis)}


def bench_argv(url: str, rate: float, a: argparse.Namespace, seed: int) -> list[str]:
    return ["--base-url", url, "--model", "SmolLM2-135M-Instruct", "--workload", "mixed",
            "--num-prompts", str(a.num_prompts), "--input-len", str(a.short_input), "--output-len", str(a.short_output),
            "--long-input-len", str(a.long_input), "--long-output-len", str(a.long_output),
            "--long-fraction", str(a.long_fraction), "--ignore-eos", "--request-rate", fmt_rate(rate),
            "--seed", str(seed), "--num-warmups", "1", "--max-duration", str(a.max_duration), "--disable-tqdm",
            "--goodput", f"ttft:{a.slo_ttft}", f"tpot:{a.slo_tpot}"]


def plot(cells: dict, rates: list[float], path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, labels = rate_axis(rates)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = (("ttft_p99", "TTFT p99 (ms)", a.slo_ttft), ("tpot_p99", "TPOT p99 (ms)", a.slo_tpot),
              ("goodput", "goodput (req/s)", None), ("attainment", "SLO attainment (%)", None))
    for ax, (key, label, slo) in zip(axes, panels):
        for layout in LAYOUTS:
            ax.plot(xs, [cells[(layout, r)][key] for r in rates], marker="o", label=layout)
        if slo:
            ax.axhline(slo, color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"SmolLM2 on 2 cores, mixed workload (SLO ttft {a.slo_ttft:g} ms, tpot {a.slo_tpot:g} ms); "
                 f"median of {a.repeats} repeats", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def measure(a: argparse.Namespace, rates: list[float], t0: float) -> dict[tuple[str, float], list[dict]]:
    """Run every (repeat, rate, layout); return the metrics of each run."""
    raw: dict[tuple[str, float], list[dict]] = {(lay, r): [] for lay in LAYOUTS for r in rates}
    with Procs(RESULTS / "disagg" / "logs") as procs:
        urls = start_layouts(procs, a)
        say(f"both layouts up after {time.monotonic() - t0:.0f} s: {urls}")
        for rep in range(a.repeats):
            for rate in rates:
                for layout in LAYOUTS:
                    doc = bench(bench_argv(urls[layout], rate, a, seed=rep))
                    m = doc["runs"][0]["metrics"]
                    raw[(layout, rate)].append(m)
                    say(f"repeat {rep} rate {fmt_rate(rate)} {layout}: TTFT p99 {m['ttft_ms']['p99']:.0f} ms, "
                        f"TPOT p99 {m['tpot_ms']['p99']:.0f} ms, goodput {m['request_goodput']:.3f} req/s, "
                        f"failed {m['failed']}")
    return raw


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1,1.5")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=20)
    p.add_argument("--short-input", type=int, default=64)
    p.add_argument("--short-output", type=int, default=32)
    p.add_argument("--long-input", type=int, default=768)
    p.add_argument("--long-output", type=int, default=4)
    p.add_argument("--long-fraction", type=float, default=0.3)
    p.add_argument("--slo-ttft", type=float, default=4000.0, help="ms")
    p.add_argument("--slo-tpot", type=float, default=150.0, help="ms")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-duration", type=float, default=150.0, help="seconds per run")
    p.add_argument("--from-results", action="store_true",
                   help="rewrite the doc section from bench/results/disagg/results.json without running")
    a = p.parse_args()
    rates = [math.inf if x == "inf" else float(x) for x in a.rates.split(",")]
    t0 = time.monotonic()
    load0 = loadavg()
    if a.from_results:
        saved = json.loads((RESULTS / "disagg" / "results.json").read_text())
        raw = {(lay, r): saved[f"{lay}@{fmt_rate(r)}"] for lay in LAYOUTS for r in rates}
    else:
        raw = measure(a, rates, t0)
    cells = {}
    for key, runs in raw.items():
        cells[key] = {"ttft_p99": median([m["ttft_ms"]["p99"] for m in runs]),
                      "tpot_p99": median([m["tpot_ms"]["p99"] for m in runs]),
                      "ttft_p50": median([m["ttft_ms"]["median"] for m in runs]),
                      "tpot_p50": median([m["tpot_ms"]["median"] for m in runs]),
                      "itl_p99": median([m["itl_ms"]["p99"] for m in runs]),
                      "goodput": median([m["request_goodput"] for m in runs]),
                      "attainment": 100 * median([m["slo_attainment"] for m in runs]),
                      "failed": sum(m["failed"] for m in runs)}
    (RESULTS / "disagg").mkdir(parents=True, exist_ok=True)
    if not a.from_results:
        (RESULTS / "disagg" / "results.json").write_text(json.dumps(
            {f"{lay}@{fmt_rate(r)}": v for (lay, r), v in raw.items()}, indent=2, default=str))
    plot(cells, rates, FIGURES / "disagg_vs_colocated.png", a)
    rows = []
    for r in rates:
        c, d = cells[("colocated", r)], cells[("disaggregated", r)]
        for layout, x in (("colocated", c), ("disaggregated", d)):
            rows.append([fmt_rate(r), layout, f"{x['ttft_p50']:.0f}", f"{x['ttft_p99']:.0f}", f"{x['tpot_p50']:.0f}",
                         f"{x['tpot_p99']:.0f}", f"{x['itl_p99']:.0f}", f"{x['goodput']:.3f}", f"{x['attainment']:.0f}", x["failed"]])
        rows.append([fmt_rate(r), "**disagg / colo**", f"{d['ttft_p50'] / c['ttft_p50']:.2f}",
                     f"{d['ttft_p99'] / c['ttft_p99']:.2f}", f"{d['tpot_p50'] / c['tpot_p50']:.2f}",
                     f"{d['tpot_p99'] / c['tpot_p99']:.2f}", f"{d['itl_p99'] / c['itl_p99']:.2f}",
                     f"{d['goodput'] / c['goodput']:.2f}" if c["goodput"] else "n/a", "", ""])
    def ratio(key: str) -> str:
        return ", ".join(f"{cells[('disaggregated', r)][key] / cells[('colocated', r)][key]:.2f}" if
                         cells[("colocated", r)][key] else "n/a" for r in rates)

    reading = (f"**Reading:** at rates {', '.join(fmt_rate(r) for r in rates)} req/s the disaggregated/colocated "
               f"ratio is {ratio('tpot_p99')} for TPOT p99, {ratio('itl_p99')} for ITL p99, {ratio('ttft_p99')} for "
               f"TTFT p99 and {ratio('goodput')} for goodput (below 1 = disaggregation lower, i.e. better for "
               "latencies, worse for goodput).")
    table = md_table(["rate (req/s)", "layout", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
                      "ITL p99 ms", "goodput req/s", "SLO att. %", "failed"], rows)
    cmd = " ".join(["python bench/disagg_vs_colocated.py"] + sys.argv[1:])
    body = f"""## Disaggregated vs colocated on the same two cores

Command (took {(time.monotonic() - t0) / 60:.1f} min): `{cmd}`

{conditions(load0)}

SmolLM2-135M-Instruct {a.dtype}. **Colocated**: one server, 2 torch threads, pinned to cores 0,1,
requests sent to it directly. **Disaggregated**: ctx server on core 0 and gen server on core 1 (1
thread each, `taskset`), KV over TCP, requests through the orchestrator. Workload `mixed`:
{a.num_prompts} requests per run, {a.long_fraction:.0%} long prompts ({a.long_input} tokens in,
{a.long_output} out) among short ones ({a.short_input} in, {a.short_output} out), `--ignore-eos`,
Poisson arrivals. Goodput SLOs: TTFT ≤ {a.slo_ttft:g} ms and TPOT ≤ {a.slo_tpot:g} ms. Every cell is the
median of {a.repeats} repeats; the layouts alternate within each repeat, and the ratio rows divide
those medians.

{table}

![disaggregated vs colocated](figures/disagg_vs_colocated.png)

{reading}
"""
    update_section("disagg", body)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
