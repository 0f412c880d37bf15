"""Experiment: two checkouts' orchestrators side by side on the same fake workers (an A/B of a change).

    .venv/bin/python bench/orchestrator_ab.py --base /path/to/other/checkout \\
        [--routers round_robin,kv_cache_aware] [--styles context_first,generation_first] [--repeats 4]

The setup of ``bench/orchestrator_overhead.py`` (fake workers A and B on core 0, routers on core 1,
wrk on core 0), with two orchestrators per router and style: one run from ``--base`` (its code,
its ``python -m orchestrator``) and one from this checkout, both in front of the same two fake
workers. Runs alternate base / this checkout within each repeat, so both see the same minutes of
a machine that other jobs may share. Per orchestrator and repeat:

- **c1**: ``--requests`` streamed 16-token completions at concurrency 1, a new 32-word prompt
  each (what the overhead bench's latency runs send; ``kv_cache_aware`` tokenizes every one),
  through one keep-alive connection of this process: client-side TTFT and E2EL medians (ms) and
  the orchestrator's CPU per request (µs: its threads' on-CPU time, ``/proc/PID/task/*/schedstat``,
  over the run; at concurrency 1 that includes a wake-up of the event loop per socket event);
- **wrk**: ``--wrk-seconds`` of wrk (1 thread, 32 connections, one fixed prompt): req/s and CPU µs
  per request.

Prints medians over the repeats, per target, with the 1-min load average at start and end: CPU
per request is the number a loaded machine changes least; latencies under load are rough.

``--together`` (wrk only): per router and style, base and this checkout are driven at the same
time by one wrk each (both orchestrators on core 1, both wrks on core 0), so both see the same
instants and share of the machine; prints req/s and CPU, user and system µs per request.
``--max-tokens`` sets the streamed tokens per wrk request (default 16).

``--paired`` (c1 only, no wrk): each prompt goes to base and to this checkout back to back
(alternating which first), so a load that drifts between runs cancels out of the per-prompt
differences; prints both sides' medians and the median difference (this - base, ms).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orchestrator_overhead as oo  # noqa: E402
import yaml  # noqa: E402
from _c1 import connect, interleaved, one_request, prompt_request  # noqa: E402
from _harness import PY, RESULTS, Procs, free_port, loadavg, median, say  # noqa: E402


def cpu_s(pid: int) -> float:
    """On-CPU seconds of every thread of ``pid`` so far (``/proc/PID/task/*/schedstat``: nanoseconds,
    finer than the clock ticks of ``/proc/PID/stat``, so short runs still resolve µs per request)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that exited while we looked
    return total / 1e9


def c1_run(url: str, pid: int, n: int, seed: int) -> dict:
    """``n`` sequential streamed completions over one raw keep-alive connection (bounded: 10 s
    per request); TTFT/E2EL medians (ms, first SSE byte / last byte) and the router's CPU µs/req."""
    rng = random.Random(seed)
    sock = connect(url)
    ttft, e2el = [], []
    cpu0 = cpu_s(pid)
    try:
        for _ in range(n):
            t, e = one_request(sock, url, prompt_request(rng))
            ttft.append(t)
            e2el.append(e)
    finally:
        sock.close()
    return {"ttft_ms": median(ttft), "e2el_ms": median(e2el), "cpu_us": 1e6 * (cpu_s(pid) - cpu0) / n}


def paired_c1(base_url: str, this_url: str, n: int, seed: int) -> dict:
    """``--paired``: ``n`` prompts, each sent to both orchestrators back to back (which one first
    alternates), one keep-alive connection each: the per-prompt differences this - base (ms) see
    the same instant of the machine, so a load that drifts between runs cancels out. Returns the
    medians of both sides and of the differences."""
    rows = interleaved({"base": base_url, "this": this_url}, n, seed, warmup=0)
    b, t = rows["base"], rows["this"]
    return {"base_ttft_ms": median([x[0] for x in b]), "this_ttft_ms": median([x[0] for x in t]),
            "d_ttft_ms": median([y[0] - x[0] for x, y in zip(b, t)]),
            "base_e2el_ms": median([x[1] for x in b]), "this_e2el_ms": median([x[1] for x in t]),
            "d_e2el_ms": median([y[1] - x[1] for x, y in zip(b, t)])}


def start_workers(procs: Procs, tok_dir: Path) -> tuple[int, int]:
    """Fake workers A (prefill) and B (decode) on core 0, as the overhead bench starts them; their ports."""
    if not (tok_dir / "tokenizer.json").exists():
        raise SystemExit(f"no tokenizer in {tok_dir}: run bench/orchestrator_overhead.py once (it writes it)")
    ports = free_port(), free_port()
    for name, role, port in (("worker_a", "prefill", ports[0]), ("worker_b", "decode", ports[1])):
        procs.start(name, [PY, str(oo.ROOT / "bench" / "fake_worker.py"), "--port", str(port), "--role", role,
                           "--tokenizer-dir", str(tok_dir)], cores="0")
        procs.wait_http(name, f"http://127.0.0.1:{port}/health", 30)
    return ports


def start_pair(procs: Procs, base: Path, router: str, style: str, pa: int, pb: int, tok_dir: Path) -> dict[str, tuple]:
    """Two orchestrators (``base`` and this checkout) for one router and style: name -> (url, pid)."""
    out = {}
    for side, root in (("base", base), ("this", oo.ROOT)):
        port = free_port()
        topo = RESULTS / "overhead" / f"ab-{side}-{router}-{style}.yaml"
        topo.write_text(yaml.safe_dump({
            "model": {"path": str(tok_dir), "name": "fake-model"},
            "orchestrator": {"host": "127.0.0.1", "port": port, "router": router, "health_interval_s": 1.0,
                             "max_inflight_requests": 4096, "schedule_style": style},
            "pools": {"ctx": {"servers": [{"host": "127.0.0.1", "port": pa}]},
                      "gen": {"servers": [{"host": "127.0.0.1", "port": pb}]}}}, sort_keys=False))
        name = f"{side} {router} {style}"
        # Run from the checkout's root: ``-m orchestrator`` imports the package found there first.
        cmd = f"cd {shlex.quote(str(root))} && exec taskset -c 1 {shlex.quote(PY)} -m orchestrator --config " \
              f"{shlex.quote(str(topo))} --log-level warning"
        proc = procs.start(name, ["sh", "-c", cmd])
        out[name] = (f"http://127.0.0.1:{port}", proc.pid)
        procs.wait_http(name, out[name][0] + "/health", 60)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="root of the other checkout (its orchestrator/)")
    p.add_argument("--routers", default="round_robin,kv_cache_aware")
    p.add_argument("--styles", default="context_first,generation_first")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--wrk-seconds", type=int, default=4)
    p.add_argument("--paired", action="store_true",
                   help="c1 only: each prompt to base and this back to back; medians of the differences")
    p.add_argument("--together", action="store_true",
                   help="wrk only: base and this driven at the same time, one wrk each (module docstring)")
    p.add_argument("--max-tokens", type=int, default=16, help="streamed tokens per wrk request (default 16)")
    a = p.parse_args()
    ns = argparse.Namespace(conc=32, wrk_threads=1, wrk_seconds=a.wrk_seconds, max_tokens=a.max_tokens)
    tok_dir = RESULTS / "overhead" / "tokenizer"
    load0 = loadavg()
    results: dict[str, list[dict]] = {}
    with Procs(RESULTS / "overhead" / "logs") as procs:
        pa, pb = start_workers(procs, tok_dir)
        targets: dict[str, tuple] = {}
        for style in a.styles.split(","):
            for router in a.routers.split(","):
                targets.update(start_pair(procs, a.base.resolve(), router, style, pa, pb, tok_dir))
        for url, pid in targets.values():
            c1_run(url, pid, 20, 99)  # warm up (kv_cache_aware loads its tokenizer on the first request)
        if a.paired:
            return _report_paired(targets, a, load0)
        if a.together:
            return _report_together(targets, a, ns, load0)
        for rep in range(a.repeats):
            for name, (url, pid) in targets.items():
                row = c1_run(url, pid, a.requests, rep)
                w = oo.run_wrk(url, ns, rep, pid)
                row.update(wrk_rps=w["request_throughput"], wrk_cpu_us=w["cpu_us_per_request"])
                results.setdefault(name, []).append(row)
            say(f"repeat {rep} done, 1-min load average {loadavg():.1f}")
    say(f"1-min load average {load0:.1f} -> {loadavg():.1f}; medians of {a.repeats} repeats")
    print("| orchestrator | c1 TTFT p50 ms | c1 E2EL p50 ms | c1 CPU µs/req | wrk req/s | wrk CPU µs/req |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, rows in results.items():
        m = {k: median([r[k] for r in rows]) for k in rows[0]}
        print(f"| {name} | {m['ttft_ms']:.2f} | {m['e2el_ms']:.2f} | {m['cpu_us']:.0f} | {m['wrk_rps']:.0f} | "
              f"{m['wrk_cpu_us']:.0f} |")
    return 0


def user_sys_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of ``pid`` so far (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _report_together(targets: dict[str, tuple], a: argparse.Namespace, ns: argparse.Namespace, load0: float) -> int:
    """``--together``: per router and style, one wrk against base and one against this at the same
    time (both on core 0, both orchestrators on core 1): each sees the same instants of the machine
    and the same share of the core, so their CPU per request compares without the drift between
    runs that the sequential A/B has. Prints medians of req/s, CPU, user and system µs per request."""
    pairs = [(name.removeprefix("base "), name, "this" + name.removeprefix("base"))
             for name in targets if name.startswith("base ")]
    rows: dict[str, list[tuple[float, ...]]] = {}
    for rep in range(a.repeats):
        for _, *names in pairs:
            before = {n: user_sys_s(targets[n][1]) for n in names}
            out: dict[str, dict] = {}
            runs = [threading.Thread(target=lambda n=n: out.__setitem__(n, oo.run_wrk(targets[n][0], ns, rep,
                                                                                     targets[n][1])))
                    for n in names]
            for t in runs:
                t.start()
            for t in runs:
                t.join(a.wrk_seconds + 120)
            for n in names:
                (u0, s0), (u1, s1), w = before[n], user_sys_s(targets[n][1]), out[n]
                done = max(w["requests"], 1)
                rows.setdefault(n, []).append((w["request_throughput"], w["cpu_us_per_request"],
                                               1e6 * (u1 - u0) / done, 1e6 * (s1 - s0) / done))
        say(f"repeat {rep} done, 1-min load average {loadavg():.1f}")
    say(f"1-min load average {load0:.1f} -> {loadavg():.1f}; medians of {a.repeats} repeats, base and this "
        f"driven together ({ns.conc} connections each, {a.max_tokens} tokens per request)")
    print("| orchestrator | wrk req/s | CPU µs/req | user µs/req | system µs/req |")
    print("|---|---:|---:|---:|---:|")
    for name, rs in rows.items():
        m = [median([r[i] for r in rs]) for i in range(4)]
        print(f"| {name} | {m[0]:.0f} | {m[1]:.0f} | {m[2]:.0f} | {m[3]:.0f} |")
    return 0


def _report_paired(targets: dict[str, tuple], a: argparse.Namespace, load0: float) -> int:
    pairs = [(name.removeprefix("base "), url, targets["this" + name.removeprefix("base")][0])
             for name, (url, _) in targets.items() if name.startswith("base ")]
    rows: dict[str, list[dict]] = {}
    for rep in range(a.repeats):
        for label, base_url, this_url in pairs:
            rows.setdefault(label, []).append(paired_c1(base_url, this_url, a.requests, rep))
        say(f"repeat {rep} done, 1-min load average {loadavg():.1f}")
    say(f"1-min load average {load0:.1f} -> {loadavg():.1f}; medians of {a.repeats} repeats of "
        f"{a.requests} paired prompts")
    print("| router, style | TTFT p50 base | TTFT p50 this | Δ TTFT p50 | E2EL p50 base | E2EL p50 this | Δ E2EL p50 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, rs in rows.items():
        m = {k: median([r[k] for r in rs]) for k in rs[0]}
        print(f"| {label} | {m['base_ttft_ms']:.3f} | {m['this_ttft_ms']:.3f} | {m['d_ttft_ms']:+.3f} | "
              f"{m['base_e2el_ms']:.3f} | {m['this_e2el_ms']:.3f} | {m['d_e2el_ms']:+.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
