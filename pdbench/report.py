"""Results table, JSON document and matplotlib plots of one or more benchmark runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .metrics import BenchMetrics


def fmt_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _f(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_table(m: BenchMetrics, title: str) -> str:
    """The terminal table of one run (the layout of ``vllm bench serve``)."""
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]

    def row(label: str, value: str) -> None:
        lines.append(f"{label:<{width - 14}}{value:>14}")

    row("Successful requests:", str(m.completed))
    row("Failed requests:", str(m.failed))
    row("Benchmark duration (s):", _f(m.duration_s))
    row("Total input tokens:", str(m.total_input_tokens))
    row("Total generated tokens:", str(m.total_output_tokens))
    row("Cached prompt tokens:", str(m.total_cached_tokens))
    row("Prefix cache hit rate (%):", _f(100.0 * m.prefix_hit_rate, 1))
    row("Request throughput (req/s):", _f(m.request_throughput))
    if m.request_goodput is not None:
        row("SLOs (ms):", " ".join(f"{k}:{v:g}" for k, v in m.goodput_slos_ms.items()))
        row("Request goodput (req/s):", _f(m.request_goodput))
        row("SLO attainment (%):", _f(100.0 * (m.slo_attainment or 0.0), 1))
    row("Output token throughput (tok/s):", _f(m.output_throughput))
    row("Total token throughput (tok/s):", _f(m.total_token_throughput))
    for name, label, stats in (("Time to First Token", "TTFT", m.ttft_ms),
                               ("Time per Output Token (excl. 1st token)", "TPOT", m.tpot_ms),
                               ("Inter-token Latency", "ITL", m.itl_ms),
                               ("End-to-end Latency", "E2EL", m.e2el_ms)):
        lines.append(f"{name:-^{width}}")
        row(f"Mean {label} (ms):", _f(stats["mean"]))
        row(f"Median {label} (ms):", _f(stats["median"]))
        for key, val in stats.items():
            if key.startswith("p") and key != "p50":
                row(f"P{key[1:]} {label} (ms):", _f(val))
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep(runs: list[dict]) -> str:
    """One line per request rate: the numbers a sweep is read by."""
    head = (f"{'rate':>6} {'conc':>5} {'ok':>5} {'req/s':>7} {'out tok/s':>9} {'goodput':>8} {'SLO %':>6} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}")
    lines = [head]
    for run in runs:
        m = run["metrics"]
        lines.append(
            f"{fmt_rate(run['request_rate']):>6} {str(run['max_concurrency'] or '-'):>5} {m['completed']:>5} "
            f"{_f(m['request_throughput']):>7} {_f(m['output_throughput'], 1):>9} {_f(m['request_goodput']):>8} "
            f"{_f(None if m['slo_attainment'] is None else 100 * m['slo_attainment'], 1):>6} "
            f"{_f(m['ttft_ms']['median'], 1):>9} {_f(m['ttft_ms'].get('p99'), 1):>9} "
            f"{_f(m['tpot_ms']['median'], 1):>9} {_f(m['tpot_ms'].get('p99'), 1):>9}")
    return "\n".join(lines)


def format_turns(turns: list[dict]) -> str:
    """One line per turn of a multiturn run, then turn N's TTFT p50 over turn 1's."""
    head = (f"{'turn':>4} {'ok':>4} {'failed':>6} {'prompt tok':>10} {'cached tok':>10} {'hit %':>6} "
            f"{'TTFT p50':>9} {'TTFT p90':>9} {'E2EL p50':>9}")
    lines = [head]
    for t in turns:
        lines.append(f"{t['turn']:>4} {t['completed']:>4} {t['failed']:>6} {_f(t['mean_prompt_tokens'], 1):>10} "
                     f"{_f(t['mean_cached_tokens'], 1):>10} {_f(100 * t['prefix_hit_rate'], 1):>6} "
                     f"{_f(t['ttft_ms']['median'], 1):>9} {_f(t['ttft_ms'].get('p90'), 1):>9} "
                     f"{_f(t['e2el_ms']['median'], 1):>9}")
    if len(turns) > 1:
        first, last = turns[0]["ttft_ms"]["median"], turns[-1]["ttft_ms"]["median"]
        ratio = last / first if first and not math.isnan(first) and not math.isnan(last) else None
        lines.append(f"turn {turns[-1]['turn']} TTFT p50 / turn 1 TTFT p50: {_f(ratio)}")
    return "\n".join(lines)


def _json_safe(obj):
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(doc: dict, path: Path) -> Path:
    """Strict JSON (NaN → null, inf → "inf")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(doc), indent=2, allow_nan=False))
    return path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    xs = sorted(values)
    return xs, [(i + 1) / len(xs) for i in range(len(xs))]


def plot_cdfs(runs: list[dict], path: Path, slos: dict[str, float] | None = None) -> Path:
    """TTFT and TPOT CDFs, one curve per run (labelled by request rate)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "ttfts_ms", "TTFT (ms)"), (axes[1], "tpots_ms", "TPOT (ms)")):
        for run in runs:
            vals = [v for v in run["requests"][key] if v is not None]
            if vals:
                xs, ys = _cdf(vals)
                ax.step(xs, ys, where="post", label=f"rate {fmt_rate(run['request_rate'])}")
        slo = (slos or {}).get(key[:4])
        if slo:
            ax.axvline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def rate_axis(rates: list[float]) -> tuple[list[float], list[str]]:
    """x positions for request rates; ``inf`` goes one step past the largest finite rate."""
    finite = [r for r in rates if not math.isinf(r)]
    top = max(finite) * 1.5 if finite else 1.0
    return [top if math.isinf(r) else r for r in rates], [fmt_rate(r) for r in rates]


def plot_goodput(series: dict[str, list[dict]], path: Path, title: str = "") -> Path:
    """Goodput (req/s) and SLO attainment (%) versus request rate, one line per series name."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, runs in series.items():
        runs = sorted(runs, key=lambda r: r["request_rate"])
        xs, labels = rate_axis([r["request_rate"] for r in runs])
        good = [r["metrics"]["request_goodput"] or 0.0 for r in runs]
        att = [100.0 * (r["metrics"]["slo_attainment"] or 0.0) for r in runs]
        axes[0].plot(xs, good, marker="o", label=name)
        axes[1].plot(xs, att, marker="o", label=name)
        for ax in axes:
            ax.set_xticks(xs, labels)
    axes[0].set_ylabel("goodput (req/s)")
    axes[1].set_ylabel("SLO attainment (%)")
    axes[1].set_ylim(0, 102)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
