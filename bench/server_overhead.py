"""Experiment (issue 11): where the per-token time of one real server goes, next to the bare engine step.

    .venv/bin/python bench/server_overhead.py [--dtype bfloat16] [--threads 2] [--cores 0,1]
        [--num-prompts 8] [--input-len 128] [--output-len 64] [--concurrencies 1,8] [--no-bare]

1. **bare**: the engine alone (no HTTP, IPC or lattice) in a child pinned to ``--cores``: B
   requests of ``--input-len`` prompt tokens are prefilled, then ``--output-len`` decode steps are
   timed (``bench/engine_step.py``'s loop) — batch 1 and 8, the median step and the mean of each
   stage of ``LLMEngine.step`` (the engine's own clock, ``engine.step_timing``).
2. **server**: one server (``python -m ctx_worker``, the MPI lattice: HTTP frontend + rank 0 over
   IPC; requests without ``disaggregated_params`` run colocated) pinned to the same cores, driven
   by ``pdserve bench`` in this process (token-id prompts of exactly ``--input-len`` tokens,
   ``--output-len`` tokens, ``ignore_eos``, streamed, greedy) at each concurrency. Around each run
   it reads the engine's step clock and the engine loop's iteration clock from ``/server_info``
   (cumulative seconds per stage and kind, ``engine.step_timing``) and the CPU seconds of rank 0,
   the frontend and this load generator (``/proc/PID/stat``; ``process_time`` for this process).

Prints a JSON line per measurement and a markdown table per concurrency: per output token, the
client's TPOT next to the rank's loop iteration split into its stages (the wait for commands, the
step's stages, the hooks and the flush to the lanes), the time of prefill iterations and idle
iterations spread over the tokens, and the CPU each process spent per token. Raw JSON goes to
``bench/results/server_overhead/``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from _harness import PY, RESULTS, ROOT, Procs, bench, loadavg, say, server_url, write_topology  # noqa: E402
from _threads import cpu_by_thread, threads  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
OUT = RESULTS / "server_overhead"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=2, help="engine.num_threads (torch intra-op threads)")
    p.add_argument("--cores", default="0,1", help="taskset cores of the server and of the bare child")
    p.add_argument("--num-prompts", type=int, default=8, help="requests per concurrency slot")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrencies", default="1,8")
    p.add_argument("--repeats", type=int, default=1, help="bare + every concurrency, this many times in turn")
    p.add_argument("--cpu-binds", default="off", help="engine.cpu_bind of the server, comma-separated for an A/B "
                   "in the same run: 'off,0-1' starts one server per value and measures them in turn each repeat "
                   "(';' separates lists: 'off;0,1')")
    p.add_argument("--no-bare", action="store_true", help="skip the bare engine measurement")
    p.add_argument("--bare-child", action="store_true", help=argparse.SUPPRESS)  # the pinned child of step 1
    a = p.parse_args(argv)
    a.concs = [int(c) for c in a.concurrencies.split(",")]
    a.binds = a.cpu_binds.split(";") if ";" in a.cpu_binds else a.cpu_binds.split(",")
    return a


# ---- step 1: the bare engine (runs in a pinned child) ---------------------------------------
def bare_child(a: argparse.Namespace) -> None:
    """Print one JSON line per batch size: median step ms and the mean ms of each step stage."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as an unpinned server's ranks run (engine.openmp_wait auto)
    from engine_step import decode_step_ms

    from engine.llm_engine import LLMEngine
    from pdserve.config import EngineSettings

    engine = LLMEngine(EngineSettings(dtype=a.dtype, device="cpu", num_threads=a.threads, num_kv_blocks=512,
                                      max_num_tokens=2048), "smollm2")
    decode_step_ms(engine, 1, 16, 4, False)  # warm-up
    for batch in (1, 8):
        before, th0 = engine.step_clock.snapshot("step"), threads(os.getpid())
        wall, cpu = decode_step_ms(engine, batch, a.input_len, a.output_len, False)
        stages = stage_means(before, engine.step_clock.snapshot("step"), "step", "decode")
        ths = {k: v for k, v in cpu_by_thread(th0, threads(os.getpid())).items() if v["cpu_s"] >= 0.01}
        print(json.dumps({"batch": batch, "step_ms": wall, "cpu_ms": cpu, "stages_ms": stages, "threads": ths}),
              flush=True)


def run_bare(a: argparse.Namespace) -> list[dict]:
    cmd = ["taskset", "-c", a.cores, PY, str(Path(__file__).resolve()), "--bare-child", "--dtype", a.dtype,
           "--threads", str(a.threads), "--input-len", str(a.input_len), "--output-len", str(a.output_len)]
    # its own session, as the server's ranks (executor.proxy): with the kernel's autogroups on, a
    # session is the unit the CPU is shared by, so both get the same share of a loaded machine
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, start_new_session=True)
    if res.returncode:
        raise RuntimeError(f"the bare engine child failed ({res.returncode}): {res.stderr[-2000:]}")
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    for r in rows:
        say(f"bare b{r['batch']}: step {r['step_ms']:.1f} ms (CPU {r['cpu_ms']:.1f} ms), stages {r['stages_ms']}, "
            f"threads {r['threads']}")
    return rows


# ---- step 2: the server ----------------------------------------------------------------------
def stage_means(before: dict, after: dict, prefix: str, kind: str) -> dict[str, float]:
    """Mean ms per iteration of each stage of ``kind`` between two clock snapshots (``count``: iterations)."""
    head = f"{prefix}_{kind}_"
    n = after.get(head + "count", 0) - before.get(head + "count", 0)
    out: dict[str, float] = {"count": n}
    for key, value in after.items():
        if key.startswith(head) and key.endswith("_s"):
            out[key[len(head):-2]] = 1e3 * (value - before.get(key, 0.0)) / n if n else 0.0
    return out


def stage_totals(before: dict, after: dict, prefix: str, kind: str) -> float:
    """Total seconds of every stage of ``kind`` between two snapshots."""
    head = f"{prefix}_{kind}_"
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(head) and k.endswith("_s"))


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads; ``/proc/PID/stat`` fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def find_rank0(frontend_pid: int, timeout_s: float = 10.0) -> int:
    """The pid of the ``executor.worker_main`` process below ``frontend_pid``. Raises RuntimeError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            # the python rank itself, not mpiexec or hydra_pmi_proxy (their argv names it too)
            if (cmd[:1] and b"python" in Path(cmd[0].decode(errors="replace")).name.encode()
                    and b"executor.worker_main" in cmd and _descends(int(entry.name), frontend_pid)):
                return int(entry.name)
        time.sleep(0.2)
    raise RuntimeError(f"no executor.worker_main process below pid {frontend_pid}")


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
    return False


def server_stats(url: str) -> dict:
    """A fresh stats snapshot of the server (``/server_info``). Raises httpx.HTTPError."""
    r = httpx.get(url + "/server_info", timeout=10.0, trust_env=False)
    r.raise_for_status()
    return r.json()


def bench_argv(url: str, conc: int, n: int, a: argparse.Namespace, warmups: int = 0) -> list[str]:
    return ["--base-url", url, "--model", MODEL, "--workload", "random", "--prompt-format", "ids",
            "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--range-ratio", "0",
            "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf",
            "--num-warmups", str(warmups), "--max-duration", "600", "--request-timeout", "300", "--disable-tqdm"]


def measure_point(url: str, conc: int, pids: dict[str, int], a: argparse.Namespace) -> dict:
    """One pdbench run at ``conc`` with the clocks and CPU times read around it."""
    s0, cpu0, me0 = server_stats(url), {n: proc_cpu_s(p) for n, p in pids.items()}, time.process_time()
    th0 = {n: threads(p) for n, p in pids.items()}
    load0 = loadavg()
    doc = bench(bench_argv(url, conc, conc * a.num_prompts, a))
    th1 = {n: threads(p) for n, p in pids.items()}
    me1, cpu1, s1 = time.process_time(), {n: proc_cpu_s(p) for n, p in pids.items()}, server_stats(url)
    run = doc["runs"][0]
    m, reqs = run["metrics"], run["requests"]
    tokens = sum(n for ok, n in zip(reqs["ok"], reqs["output_lens"]) if ok)
    cpu = {n: 1e3 * (cpu1[n] - cpu0[n]) / tokens for n in pids}
    cpu["load generator"] = 1e3 * (me1 - me0) / tokens
    return {"conc": conc, "tokens": tokens, "failed": m["failed"], "duration_s": m["duration_s"],
            "tok_s": m["output_throughput"], "tpot_p50": m["tpot_ms"]["median"], "tpot_mean": m["tpot_ms"]["mean"],
            "ttft_p50": m["ttft_ms"]["median"], "itl_p50": m["itl_ms"]["median"], "itl_p99": m["itl_ms"]["p99"],
            "step": stage_means(s0, s1, "step", "decode"), "loop": stage_means(s0, s1, "loop", "decode"),
            "loop_prefill_s": stage_totals(s0, s1, "loop", "prefill"),
            "loop_idle_s": stage_totals(s0, s1, "loop", "idle") + stage_totals(s0, s1, "loop", "empty"),
            "cpu_ms_per_token": cpu, "load": [load0, loadavg()],
            "threads": {n: thread_ms_per_token(th0[n], th1[n], tokens) for n in pids}}


def thread_ms_per_token(before: list, after: list, tokens: int) -> dict[str, dict]:
    """Per thread of one process: CPU ms per output token, its allowed cores, last core and niceness."""
    rows = cpu_by_thread(before, after)
    return {k: {**v, "cpu_ms_per_token": round(1e3 * v.pop("cpu_s") / max(1, tokens), 3)} for k, v in rows.items()}


def start_server(a: argparse.Namespace, procs: Procs, bind: str) -> tuple[str, dict[str, int]]:
    """The server with ``engine.cpu_bind: bind``, up and warmed up; its URL and the pids of rank 0
    and the frontend."""
    setting, _, helpers = bind.partition("+")
    name = f"server-bind-{bind.replace(',', '_').replace('+', '_')}"
    topo = OUT / f"{name}.yaml"
    doc = write_topology(topo, engine={"num_threads": a.threads, "dtype": a.dtype, "cpu_bind": setting})
    url = server_url(doc, "ctx")
    server = procs.start(name, [PY, "-m", "ctx_worker", "--config", str(topo), "--index", "0"], cores=a.cores)
    procs.wait_http(name, url + "/health", 600)
    bench(bench_argv(url, 1, 2, a))  # warm-up, not measured
    pids = {"rank 0": find_rank0(server.pid), "frontend": server.pid}
    if helpers:  # "0-1+helpers": the frontend and rank 0's unpinned threads move off the engine thread's core
        move_helpers(pids, setting)
    return url, pids


def move_helpers(pids: dict[str, int], setting: str) -> None:
    """Every thread of the frontend and every rank-0 thread that is not pinned to one core goes to
    the cores of ``setting`` after its first (the OpenMP workers' cores): an experiment (issue 11)."""
    from pdserve.cpu_bind import parse_cpu_list

    rest = set(parse_cpu_list(setting)[1:])
    for proc, pid in pids.items():
        for t in threads(pid):
            if proc == "frontend" or "," in t.allowed or "-" in t.allowed:
                os.sched_setaffinity(t.tid, rest)


def run_repeats(a: argparse.Namespace, procs: Procs) -> list[dict]:
    """Each repeat: the bare child (the idle servers wait meanwhile), then every concurrency on
    each server (one per ``--cpu-binds`` value, in turn; the others idle meanwhile)."""
    servers = {bind: start_server(a, procs, bind) for bind in a.binds}
    reps = []
    for rep in range(a.repeats):
        bare = [] if a.no_bare else run_bare(a)
        points = []
        for conc in a.concs:
            for bind, (url, pids) in servers.items():
                p = {"cpu_bind": bind, **measure_point(url, conc, pids, a)}
                say(f"repeat {rep} c{conc} cpu_bind {bind}: {json.dumps(p)}")
                points.append(p)
        reps.append({"repeat": rep, "bare": bare, "server": points})
    procs.stop_all()
    return reps


# ---- report ----------------------------------------------------------------------------------
def breakdown(p: dict, bare: dict | None) -> str:
    """Markdown: ms per output token at one concurrency, from the client's TPOT down to the stages."""
    loop, step, conc = p["loop"], p["step"], p["conc"]
    rows = [("client TPOT (mean / p50)", f"{p['tpot_mean']:.2f} / {p['tpot_p50']:.2f}", "")]
    it = sum(v for k, v in loop.items() if k != "count")
    rows.append(("rank 0 decode iteration (mean)", f"{it:.2f}", f"{loop['count']} iterations"))
    for stage in ("wait", "commands"):
        rows.append((f"  loop: {stage}", f"{loop.get(stage, 0):.2f}", ""))
    for stage in ("schedule", "plan", "forward", "sample", "outputs"):
        b = "" if bare is None else f"bare b{bare['batch']}: {bare['stages_ms'].get(stage, 0):.2f}"
        rows.append((f"  step: {stage}", f"{step.get(stage, 0):.2f}", b))
    rows.append(("  loop: step other (watchdog wrap, move_out)",
                 f"{loop.get('step', 0) - sum(step.get(s, 0) for s in ('schedule', 'plan', 'forward', 'sample', 'outputs')):.2f}", ""))
    for stage in ("hooks", "flush"):
        rows.append((f"  loop: {stage}", f"{loop.get(stage, 0):.2f}", ""))
    rows.append(("prefill iterations, spread over the decode iterations",
                 f"{1e3 * p['loop_prefill_s'] / max(1, loop['count']):.2f}", f"{p['loop_prefill_s']:.2f} s in all"))
    rows.append(("idle iterations, spread over the decode iterations",
                 f"{1e3 * p['loop_idle_s'] / max(1, loop['count']):.2f}", f"{p['loop_idle_s']:.2f} s in all"))
    cpu = ", ".join(f"{n} {v:.2f}" for n, v in p["cpu_ms_per_token"].items())
    rows.append(("CPU ms per output token", "", cpu))
    for proc, ths in p.get("threads", {}).items():
        busy = [f"{k} {v['cpu_ms_per_token']:.2f} (cores {v['allowed']}, nice {v['nice']})"
                for k, v in ths.items() if v["cpu_ms_per_token"] >= 0.01]
        rows.append((f"  {proc} threads (CPU ms per token)", "", "; ".join(busy)))
    out = [f"c{conc}, cpu_bind {p.get('cpu_bind', 'off')}: {p['tok_s']:.1f} tok/s, {p['tokens']} output tokens, "
           f"load {p['load'][0]:.1f} → {p['load'][1]:.1f}",
           "", "| per decode iteration | ms | note |", "|---|---:|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.bare_child:
        bare_child(a)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    say(f"load average at start: {loadavg():.2f}")
    with Procs(OUT / "logs") as procs:
        reps = run_repeats(a, procs)
    (OUT / f"{a.dtype}.json").write_text(json.dumps({"args": vars(a), "repeats": reps}, indent=1))
    for r in reps:
        by_batch = {b["batch"]: b for b in r["bare"]}
        for p in r["server"]:
            print(f"\nrepeat {r['repeat']}, ", end="")
            print(breakdown(p, by_batch.get(1 if p["conc"] == 1 else 8)))
    say(f"load average at end: {loadavg():.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
