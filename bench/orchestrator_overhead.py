"""Experiment: what a router adds. The same near-free workers (``bench/fake_worker.py``) reached
directly, through the pdserve orchestrator, and through sglang-router in PD mode.

    .venv/bin/python bench/orchestrator_overhead.py [--sglang-python /tmp/peers-sgl/bin/python]

Two fake workers A and B answer at once (no model). Paths:

- **direct**: client → B (one plain streamed completion).
- **pdserve** (``schedule_style: context_first``): client → orchestrator → A (``context_only``,
  JSON answer) then → B (``generation_only``, streamed and relayed): two upstream calls in sequence.
- **pdserve gen-first** (``schedule_style: generation_first``): client → orchestrator → A and B at
  once; B really waits: it streams once A has answered the ``context_only`` request, told by a
  line A pushes on a subscription B opened once (``--fake-ctx-signal push``, the default:
  ``bench/fake_ctx_feed.py``) or by A's answer to B's ``POST /disagg/lease`` (``pull``, what the
  real gen server does, at ~0.4 ms more of the workers' CPU per request on the client's core).
  One round trip on the orchestrator's critical path, one A → B signal.
- **sglang-router** (``--pd-disaggregation``, prefill A, decode B): one request sent to A
  *and* B at once with ``bootstrap_host/port/room`` added; the client gets B's stream. (In SGLang
  the KV handoff then runs worker to worker; here nothing moves.)

Routers are pinned to core 1 (``--router-cores``), workers and the load generators to core 0 (taskset); sglang-router
uses round-robin, pdserve runs once per ``--pdserve-routers`` policy and ``--pdserve-workers``
process count (one orchestrator each, the others idle meanwhile). Latency: concurrency 1, ``--latency-prompts`` streamed requests of 16
tokens through the Python client (``pdserve bench``); added latency = router's TTFT/E2EL minus
direct. Throughput, two clients: the Python client (rate inf, concurrency ``--conc``: one Python
process, which tops out near 400-800 req/s on one core, so it cannot show a faster router) and
``wrk`` (compiled, epoll, ``--wrk-threads`` threads on core 0, ``--conc`` keep-alive connections,
``--wrk-seconds`` per run: ~10x less CPU per request than the Python client). Targets alternate
within each repeat; cells are medians of ``--repeats``. Writes the ``overhead`` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import yaml  # noqa: E402

from _c1 import interleaved  # noqa: E402
from _loopback import LoopbackQuickAck  # noqa: E402
from _harness import (conditions, loadavg, FIGURES, PY, RESULTS, ROOT, Procs, bench, free_port, md_table, median, say,  # noqa: E402
                      tree_cpu_s, update_section)


def start(procs: Procs, a: argparse.Namespace, worker_args: tuple[str, ...] = ()) -> dict[str, str]:
    """Start fake workers A (ctx / prefill) and B (gen / decode) on core 0 (``worker_args`` added to
    both command lines), one pdserve orchestrator per style, router policy and process count of
    ``a``, and sglang-router when ``a.sglang_python`` exists; returns each target's URL (``direct``: B)."""
    tok_dir = RESULTS / "overhead" / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        from engine.model_files import resolve_model_path
        from engine.tokenizer import Tokenizer

        Tokenizer.from_model_path(Path(resolve_model_path("smollm2"))).hf.save_pretrained(str(tok_dir))
    pa, pb = free_port(), free_port()
    fw = str(ROOT / "bench" / "fake_worker.py")
    procs.start("worker_a", [PY, fw, "--port", str(pa), "--role", "prefill", "--tokenizer-dir", str(tok_dir),
                             *worker_args], cores="0")
    procs.start("worker_b", [PY, fw, "--port", str(pb), "--role", "decode", "--tokenizer-dir", str(tok_dir),
                             *worker_args], cores="0")
    a_url, b_url = f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"
    procs.wait_http("worker_a", a_url + "/health", 30)
    procs.wait_http("worker_b", b_url + "/health", 30)
    urls = {"direct": b_url}
    procs.worker_urls = {"worker_a": a_url, "worker_b": b_url}
    workers = [int(k) for k in a.pdserve_workers.split(",")]
    styles = a.styles.split(",")
    for style, router, k in [(st, r, k) for st in styles for r in a.pdserve_routers.split(",") for k in workers]:
        port = free_port()
        topo = RESULTS / "overhead" / f"pdserve-{router}-k{k}-{style}.yaml"
        topo.parent.mkdir(parents=True, exist_ok=True)
        topo.write_text(yaml.safe_dump({
            "model": {"path": str(tok_dir), "name": "fake-model"},
            "orchestrator": {"host": "127.0.0.1", "port": port, "router": router, "health_interval_s": 1.0,
                             "max_inflight_requests": 4096, "num_workers": k, "schedule_style": style},
            "pools": {"ctx": {"servers": [{"host": "127.0.0.1", "port": pa}]},
                      "gen": {"servers": [{"host": "127.0.0.1", "port": pb}]}},
        }, sort_keys=False))
        name = (f"pdserve {router}" + (f" K={k}" if workers != [1] else "")
                + (" gen-first" if style == "generation_first" else ""))
        procs.start(name, [PY, "-m", "orchestrator", "--config", str(topo), "--log-level", "warning"],
                    cores=a.router_cores)
        urls[name] = f"http://127.0.0.1:{port}"
        procs.wait_http(name, urls[name] + "/health", 60)
        wait_group(urls[name], 60)
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


def wait_group(url: str, timeout_s: float) -> None:
    """With ``num_workers`` > 1: until every worker process has reported to the owner (then it serves)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs = httpx.get(url + "/cluster/status", timeout=5, trust_env=False).json().get("processes", [])
        if all(p["alive"] and p.get("report_age_s", 9) < 1 for p in procs if p["index"]):
            return
        time.sleep(0.2)
    raise RuntimeError(f"orchestrator workers of {url} did not come up within {timeout_s:g} s")


def run_one(url: str, argv: list[str]) -> dict:
    doc = bench(["--base-url", url, "--model", "fake-model", "--workload", "random", "--prompt-format", "text", "--input-len", "32",
                 "--output-len", "16", "--disable-tqdm", "--max-duration", "120", "--num-warmups", "5", *argv])
    m = doc["runs"][0]["metrics"]
    if m["failed"]:
        raise RuntimeError(f"{m['failed']} requests failed via {url}: {doc['runs'][0]['errors'][:3]}")
    return m


def router_pid(procs: Procs, target: str) -> int | None:
    """The PID of the router process behind ``target`` (None for *direct*: no router)."""
    name = "sglang" if target.startswith("sglang") else target
    proc = procs.procs.get(name)
    return None if target == "direct" or proc is None else proc.pid


def fmt_us(value: float | None) -> str:
    return "—" if value is None or value != value else f"{value:.0f}"


def cpu_flags() -> str:
    """The flags that change what a number means here (FACTS.md: the machine is not always the same)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return "unknown"
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags) or "none of avx2/avx512"


def wrk_script(path: Path, seed: int, max_tokens: int = 16) -> Path:
    """A wrk Lua script POSTing one streamed 32-word completion (the latency runs' shape)."""
    import random

    rng = random.Random(seed)
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "sigma"]) for _ in range(32))
    body = json.dumps({"model": "fake-model", "prompt": words, "max_tokens": max_tokens, "stream": True})
    path.write_text(f"wrk.method = \"POST\"\nwrk.headers[\"Content-Type\"] = \"application/json\"\n"
                    f"wrk.body = [[{body}]]\n")
    return path


def run_wrk(url: str, a: argparse.Namespace, seed: int, router_pid: int | None = None) -> dict:
    """Max req/s of ``url`` + ``/v1/completions`` with wrk pinned to core 0, and (``router_pid``) the
    router's CPU per request over the run: CPU seconds of its process tree / requests wrk completed
    (``cpu_us_per_request``; load-independent, unlike req/s). Raises on errors."""
    port = url.rsplit(":", 1)[-1].strip("/")  # one script per target: runs may overlap (orchestrator_ab --together)
    script = wrk_script(RESULTS / "overhead" / f"wrk-{port}.lua", seed, getattr(a, "max_tokens", 16))
    cmd = ["taskset", "-c", "0", "wrk", "-t", str(a.wrk_threads), "-c", str(a.conc), "-d", f"{a.wrk_seconds}s",
           "--timeout", "10s", "-s", str(script), url + "/v1/completions"]
    cpu0 = tree_cpu_s(router_pid) if router_pid else 0.0
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.wrk_seconds + 60).stdout
    cpu = tree_cpu_s(router_pid) - cpu0 if router_pid else None
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    done = int(re.search(r"(\d+) requests in", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    if bad or errors:
        raise RuntimeError(f"wrk against {url}: {bad.group(0) if bad else ''} {errors.group(0) if errors else ''}\n{out}")
    per_req = None if cpu is None or not done else 1e6 * cpu / done
    return {"request_throughput": rps, "requests": done, "cpu_us_per_request": per_req, "output": out}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang-python", default=None, help="python of a venv with sglang-router (skipped if absent)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency-prompts", type=int, default=200)
    p.add_argument("--interleaved-prompts", type=int, default=400,
                   help="per repeat: prompts sent to every target in turn at concurrency 1 (bench/_c1.py; 0: none)")
    p.add_argument("--throughput-prompts", type=int, default=1500)
    p.add_argument("--conc", type=int, default=32)
    p.add_argument("--pdserve-routers", default="round_robin,kv_cache_aware",
                   help="one pdserve orchestrator per policy (comma-separated)")
    p.add_argument("--pdserve-workers", default="1",
                   help="orchestrator.num_workers values, one orchestrator each (comma-separated, e.g. 1,2)")
    p.add_argument("--styles", default="context_first,generation_first",
                   help="orchestrator.schedule_style values, one orchestrator per router, K and style (comma-separated)")
    p.add_argument("--router-cores", default="1", help="taskset cores of the routers (default 1)")
    p.add_argument("--section", default="overhead", help="the docs/benchmarks.md section (and figure) written")
    p.add_argument("--wrk-seconds", type=int, default=8)
    p.add_argument("--wrk-threads", type=int, default=1)
    p.add_argument("--fake-stream-writes", choices=("per-event", "one"), default="per-event",
                   help="how fake worker B writes a stream: one write per SSE event (default, the "
                        "setup of the issue's table) or all of it in one write (fake_worker.py --stream-writes)")
    p.add_argument("--fake-token-delay-ms", type=float, default=0.0,
                   help="fake worker B waits this long between streamed tokens (default 0: answers at once); "
                        "with a delay each token reaches the router on its own, as from a decoding server")
    p.add_argument("--fake-ctx-signal", choices=("push", "pull"), default="push",
                   help="how the fake gen worker waits for the fake ctx worker in generation_first "
                        "(bench/fake_ctx_feed.py): a pushed line, or the real servers' lease POST")
    p.add_argument("--dry-run", action="store_true", help="print the table; write neither docs/benchmarks.md nor the figure")
    a = p.parse_args()
    if shutil.which("wrk") is None:
        p.error("wrk is not installed (apt-get install -y wrk): the Python client alone cannot measure max req/s")
    t0 = time.monotonic()
    load0 = loadavg()
    lat: dict[str, list[dict]] = {}
    thr: dict[str, list[dict]] = {}
    wrk: dict[str, list[dict]] = {}
    inter: dict[str, list[tuple[float, float]]] = {}  # per repeat: (TTFT p50, E2EL p50) of the interleaved prompts
    calls: dict = {}
    with LoopbackQuickAck() as quickack, Procs(RESULTS / "overhead" / "logs") as procs:
        say(f"loopback quickack: {quickack.state}")
        urls = start(procs, a, ("--ctx-signal", a.fake_ctx_signal, "--stream-writes", a.fake_stream_writes,
                                "--token-delay-ms", str(a.fake_token_delay_ms)))
        say(f"targets: {urls}")
        for rep in range(a.repeats):
            for name, url in urls.items():
                m = run_one(url, ["--num-prompts", str(a.latency_prompts), "--max-concurrency", "1", "--seed", str(rep)])
                lat.setdefault(name, []).append(m)
                m2 = run_one(url, ["--num-prompts", str(a.throughput_prompts), "--max-concurrency", str(a.conc),
                                   "--request-rate", "inf", "--seed", str(rep)])
                thr.setdefault(name, []).append(m2)
                w = run_wrk(url, a, rep, router_pid(procs, name))
                wrk.setdefault(name, []).append(w)
                say(f"repeat {rep} {name}: TTFT p50 {m['ttft_ms']['median']:.2f} ms, "
                    f"p99 {m['ttft_ms']['p99']:.2f} ms; max {m2['request_throughput']:.0f} req/s (python), "
                    f"{w['request_throughput']:.0f} req/s (wrk), router CPU {fmt_us(w['cpu_us_per_request'])} µs/req")
            if a.interleaved_prompts:
                for name, samples in interleaved(urls, a.interleaved_prompts, 1000 + rep).items():
                    inter.setdefault(name, []).append((median([t for t, _ in samples]), median([e for _, e in samples])))
                say(f"repeat {rep} interleaved: " + ", ".join(
                    f"{n} {v[-1][0]:.2f}/{v[-1][1]:.2f} ms" for n, v in inter.items()) + " (TTFT/E2EL p50)")
        import httpx

        for w, wurl in procs.worker_urls.items():
            calls[w] = httpx.get(f"{wurl}/stats", trust_env=False).json()
    (RESULTS / "overhead" / "results.json").write_text(json.dumps({"latency": lat, "throughput": thr, "wrk": wrk,
                                                                    "interleaved": inter, "worker_calls": calls},
                                                                   indent=2))
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
        wrps = median([m["request_throughput"] for m in wrk[name]])
        cpu_us = median([m.get("cpu_us_per_request") for m in wrk[name]])
        summary[name] = (t50 - base_ttft50, t99 - base_ttft99, wrps)
        i_ttft, i_e2el = interleaved_added(inter, name)
        rows.append([name, f"{t50:.2f}", f"{t99:.2f}", f"{t50 - base_ttft50:+.2f}", f"{t99 - base_ttft99:+.2f}",
                     f"{e50 - base_e2e50:+.2f}", f"{e99 - base_e2e99:+.2f}", i_ttft, i_e2el, f"{rps:.0f}",
                     f"{wrps:.0f}", " / ".join(f"{m['request_throughput']:.0f}" for m in wrk[name]), fmt_us(cpu_us)])
    table = md_table(["path", "TTFT p50 ms", "TTFT p99 ms", "added TTFT p50", "added TTFT p99", "added E2EL p50",
                      "added E2EL p99", "added TTFT p50 (interleaved)", "added E2EL p50 (interleaved)",
                      "max req/s (python)", "max req/s (wrk)", "wrk runs", "router CPU µs/req (wrk)"], rows)
    if a.dry_run:
        print(table)
        return 0
    figure = "orchestrator_overhead" if a.section == "overhead" else f"orchestrator_{a.section.replace('-', '_')}"
    plot(summary, FIGURES / f"{figure}.png")
    direct_rps = summary["direct"][2]
    parts = [f"{n} adds {v[0]:+.1f} ms to TTFT at p50 ({v[1]:+.1f} ms at p99) and tops out at {v[2]:.0f} req/s "
             f"with wrk ({v[2] / direct_rps:.2f}× direct)" for n, v in summary.items() if n != "direct"]
    reading = ("**Reading:** " + "; ".join(parts) + f". Direct tops out at {direct_rps:.0f} req/s with wrk: the "
               "ceiling of this setup (wrk and both fake workers share core 0), so a router near that number is "
               "not the bottleneck here." + styles_reading(summary) + interleaved_reading(inter))
    cmd = " ".join(["python bench/orchestrator_overhead.py"] + sys.argv[1:])
    workers_note = "" if a.pdserve_workers == "1" else (
        f" `K=k`: `orchestrator.num_workers: k`, k processes on one port (SO_REUSEPORT), all of them on "
        f"core(s) {a.router_cores} (taskset is inherited).")
    title = "Orchestrator overhead: direct vs pdserve orchestrator" + (
        " vs sglang-router (PD mode)" if any(n.startswith("sglang") for n in lat) else "") + (
        ", each stream in one write" if a.fake_stream_writes == "one" else "") + (
        f", {a.fake_token_delay_ms:g} ms between tokens" if a.fake_token_delay_ms else "") + (
        "" if a.pdserve_workers == "1" else f", orchestrator.num_workers {a.pdserve_workers}, routers on core(s) "
        f"{a.router_cores}")
    signal_note = (
        "A pushes one `parked` line per request on a subscription B opened once (`--fake-ctx-signal push`, "
        "bench/fake_ctx_feed.py; the real gen server instead POSTs the ctx server's `/disagg/lease` per "
        "request — servers' CPU that this setup would put on the client's core)."
        if a.fake_ctx_signal == "push" else
        "B POSTs A's `/disagg/lease` as the real gen server does (`--fake-ctx-signal pull`; one B → A "
        "round trip on core 0 with the workers and the client, through the orchestrator's pooled HTTP/1.1 "
        "client; the real gen server uses httpx).")
    delay_note = "" if not a.fake_token_delay_ms else (
        f" B waits {a.fake_token_delay_ms:g} ms between streamed tokens (`--fake-token-delay-ms`): each token "
        "reaches a router on its own, as from a decoding server, so latencies hold that wait and the "
        "routers' CPU per request is mostly their cost per streamed chunk.")
    writes_note = (
        "B writes each streamed answer in one write, its response head included (`--fake-stream-writes one`): "
        "a router reads a stream in one piece, so the numbers are its cost per request, not per SSE chunk."
        if a.fake_stream_writes == "one" else
        "B writes each SSE event of a stream in a write of its own, at once (`--fake-stream-writes per-event`, "
        "the default): how many pieces a router reads per stream depends on how far it lags.")
    body = f"""## {title}

Command (took {(time.monotonic() - t0) / 60:.1f} min): `{cmd}`

{conditions(load0)} CPU flags: {cpu_flags()}. {quickack.note()}

The workers are `bench/fake_worker.py` (raw ASGI on uvicorn, answers at once, no model), so every
millisecond above *direct* is the router's. Routers pinned to core(s) {a.router_cores}, workers and the load
generators to core 0.{workers_note} {writes_note}{delay_note} Requests: 32-word text prompts (sglang-router rejects token-id prompts on /v1/completions), 16 streamed output tokens. Latency at
concurrency 1 ({a.latency_prompts} requests per run, Python client); max req/s at concurrency {a.conc}, rate inf,
with the Python client ({a.throughput_prompts} requests per run) and with `wrk` ({a.wrk_threads} thread,
{a.conc} keep-alive connections, {a.wrk_seconds} s per run; the Python client is one process that tops out
near 400–800 req/s on one core, wrk costs ~10× less per request). Medians of {a.repeats} repeats,
targets alternating. *Interleaved*: in each repeat {a.interleaved_prompts} more prompts at concurrency 1, each
sent to every target in turn (the order rotating by one target per prompt; `bench/_c1.py`, a raw keep-alive
socket per target), so all targets see the same instants of the VM and its drift cancels out of the
difference; the cell is the median over repeats of (target's TTFT or E2EL p50 − direct's, same repeat).
*Router CPU µs/req*: user + system CPU time of the router's process tree
(`/proc/PID/stat`) over each wrk run divided by the requests wrk completed — the router's own cost
per request, which the machine's load changes far less than it changes latencies and rates.

What each router does per request (be fair when reading the numbers):
- **pdserve orchestrator** (Python, uvicorn + uvloop + httptools, one process, its own pooled
  HTTP/1.1 client): validates the body, POSTs the context phase to A and waits for its JSON
  answer, then POSTs the generation phase to B and relays its SSE stream. Two upstream round
  trips in sequence — the cost of `context_first`. `kv_cache_aware` also tokenizes the prompt
  and hashes its blocks at the orchestrator.
- **pdserve … gen-first** (`schedule_style: generation_first`): POSTs the context phase to A and
  the generation phase to B at once and relays B's stream; B (the fake) really waits — it streams
  only once A has answered that request's context phase: {signal_note}
- The fake workers publish KV events as a real server does (`GET /kv_events`: an empty snapshot,
  then heartbeats), so `kv_cache_aware`'s indexes are synced and stay empty. Since issue 13's sixth
  pass an index that holds no block makes `kv_cache_aware` skip tokenizing (no pick can depend on
  blocks then): these rows show its cost in front of empty caches. In front of caches that hold
  blocks it also tokenizes and hashes each new prompt before the pick: ~60–90 µs of router CPU per
  new 32-word prompt on this machine (`bench/route_cost.py`).
- **sglang-router** (Rust, `--pd-disaggregation`): sends the request to A and B *at once* with
  `bootstrap_*` fields and relays B's stream; the prefill→decode handoff is the workers' business
  (over the bootstrap server), so the router's own critical path has one round trip.
- Worker calls counted by the fakes over the whole run: {json.dumps(calls)}.

{table}

![orchestrator overhead](figures/{figure}.png)

{reading}
"""
    update_section(a.section, body)
    print(table)
    return 0


def interleaved_added(inter: dict[str, list[tuple[float, float]]], name: str) -> tuple[str, str]:
    """The cells of ``name``'s interleaved columns: medians over repeats of its (TTFT, E2EL) p50 minus
    direct's in the same repeat (ms, signed; "—" when not measured)."""
    if name not in inter or "direct" not in inter:
        return "—", "—"
    pairs = list(zip(inter[name], inter["direct"]))
    ttft = median([t - d[0] for (t, _), d in pairs])
    e2el = median([e - d[1] for (_, e), d in pairs])
    return f"{ttft:+.2f}", f"{e2el:+.2f}"


def interleaved_reading(inter: dict[str, list[tuple[float, float]]]) -> str:
    """One sentence: every router's interleaved added TTFT/E2EL p50 (ms), as in the table."""
    names = [n for n in inter if n != "direct"]
    if not names:
        return ""
    cells = [f"{n} {'/'.join(interleaved_added(inter, n))}" for n in names]
    return " Interleaved (same instants for every target), added TTFT/E2EL p50 in ms: " + "; ".join(cells) + "."


def styles_reading(summary: dict) -> str:
    """One sentence per router measured in both schedule styles (same run): generation_first vs context_first."""
    out = []
    for name, (t50, _, rps) in summary.items():
        base = summary.get(name.removesuffix(" gen-first")) if name.endswith(" gen-first") else None
        if base is not None:
            out.append(f"{name}: added TTFT p50 {t50:+.2f} ms vs {base[0]:+.2f} ms for context_first, "
                       f"{rps:.0f} vs {base[2]:.0f} req/s with wrk ({rps / base[2]:.2f}×)")
    return (" Schedule styles, same run: " + "; ".join(out) + ".") if out else ""


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
    axes[1].set_ylabel("max requests/s (wrk)")
    for ax in axes:
        ax.set_xticks(list(x), names, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
