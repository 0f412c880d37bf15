"""Where the orchestrator's CPU goes under load: py-spy samples it while wrk drives it.

    .venv/bin/python bench/profile_orchestrator.py [--router round_robin] [--style context_first] [--seconds 15] \
        [--fake-stream-writes per-event|one]

Same setup as ``bench/orchestrator_overhead.py`` (fake workers and wrk on core 0, the orchestrator
on core 1, 32 keep-alive connections, streamed 16-token completions). py-spy (``pip install
py-spy``) records the orchestrator process for ``--seconds`` at 200 Hz into
``bench/results/overhead/profile-<router>[-gen-first].txt`` (collapsed stacks; feed them to a flame graph
tool) and this prints the share of samples under each frame group: the breakdown in
docs/benchmarks.md. Samples of uvloop's C code (socket I/O, epoll) show up as ``Runner.run``.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import orchestrator_overhead as oo  # noqa: E402
from _harness import RESULTS, Procs, loadavg, say  # noqa: E402

GROUPS = {  # label -> substring of a frame; a sample counts once per group whose frame it holds
    "upstream client (h1client + upstream.py)": ("orchestrator/h1client.py", "orchestrator/upstream.py"),
    "httpx/httpcore (control plane, or the old hot path)": ("httpx/", "httpcore/"),
    "SSE relay to the client": ("orchestrator/relay.py",),
    "uvicorn protocol (parse, send)": ("uvicorn/protocols",),
    "FastAPI/Starlette": ("fastapi/", "starlette/"),
    "body parse + pydantic validation": ("parse_body", "parse_client_body", "request_body.py"),
    "tokenize + block hashes (kv_cache_aware)": ("prompt_tokens.py", "block_hashes"),
    "routing": ("orchestrator/router.py", "orchestrator/kv_index.py", "orchestrator/kv_selfcheck.py"),
    "pydantic models (validation, model_dump)": ("pydantic/",),
    "JSON encode/decode (jsonio, ctx_answer)": ("orchestrator/jsonio.py", "orchestrator/ctx_answer.py"),
    "relay merge (progress, relay_logprobs)": ("orchestrator/progress.py", "orchestrator/relay_logprobs.py"),
    "dispatch (disagg, gen_first, migration, front)": ("orchestrator/disagg.py", "orchestrator/gen_first.py",
                                                       "orchestrator/migration.py", "orchestrator/front.py"),
    "metrics (prometheus_client, orchestrator/loop_metrics.py)": ("prometheus_client", "orchestrator/loop_metrics.py"),
    "logging": ("logging/",),
    "asyncio timeouts": ("asyncio/timeouts.py",),
    "event loop itself (uvloop C: I/O, epoll)": ("Runner.run (asyncio/runners.py:118)",),
}


def breakdown(path: Path) -> list[tuple[str, float]]:
    """Share of samples per group (%), each sample given to the group of its innermost matching
    frame (so the shares add up to 100 with "other"), plus the sample count."""
    total, hits = 0, collections.Counter()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        total += int(n)
        hits[_group(stack.split(";"))] += int(n)
    labels = [*GROUPS, "other"]
    return [(label, 100.0 * hits[label] / max(total, 1)) for label in labels] + [("samples", float(total))]


def _group(frames: list[str]) -> str:
    for frame in reversed(frames):
        for label, needles in GROUPS.items():
            if any(x in frame for x in needles):
                return label
    return "other"


def warm_up(url: str, n: int = 20) -> None:
    """A few requests before sampling: ``kv_cache_aware`` loads its tokenizer on the first one
    (seconds of CPU once, in a thread), which is not the per-request cost being profiled."""
    import httpx

    for _ in range(n):
        r = httpx.post(url + "/v1/completions", json={"model": "fake-model", "prompt": "warm up", "max_tokens": 4},
                       timeout=60, trust_env=False)
        r.raise_for_status()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--router", default="round_robin")
    p.add_argument("--seconds", type=int, default=15)
    p.add_argument("--conc", type=int, default=32)
    p.add_argument("--style", default="context_first", choices=("context_first", "generation_first"))
    p.add_argument("--fake-stream-writes", choices=("per-event", "one"), default="per-event",
                   help="how fake worker B writes a stream (bench/fake_worker.py --stream-writes)")
    a = p.parse_args()
    ns = argparse.Namespace(sglang_python=None, pdserve_routers=a.router, conc=a.conc, wrk_threads=1,
                            wrk_seconds=a.seconds + 2, pdserve_workers="1", styles=a.style, router_cores="1")
    suffix = "" if a.style == "context_first" else "-gen-first"
    out = RESULTS / "overhead" / f"profile-{a.router}{suffix}.txt"
    py_spy = str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():  # a py-spy installed elsewhere (its own venv, pipx) on PATH
        py_spy = shutil.which("py-spy") or py_spy
    name = f"pdserve {a.router}" + (" gen-first" if a.style == "generation_first" else "")
    with Procs(RESULTS / "overhead" / "logs") as procs:
        urls = oo.start(procs, ns, ("--stream-writes", a.fake_stream_writes))
        warm_up(urls[name])
        pid = procs.procs[name].pid
        load = loadavg()
        result: dict = {}
        driver = threading.Thread(target=lambda: result.update(oo.run_wrk(urls[name], ns, 0, pid)))
        driver.start()
        subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", str(a.seconds), "--rate", "200",
                        "--format", "raw", "-o", str(out), "--nonblocking"], check=True, timeout=a.seconds + 60)
        driver.join(a.seconds + 90)
    say(f"wrk: {result.get('request_throughput', float('nan')):.0f} req/s, orchestrator CPU "
        f"{oo.fmt_us(result.get('cpu_us_per_request'))} µs/req; 1-min load average {load:.1f} -> {loadavg():.1f}")
    for label, share in breakdown(out):
        print(f"{share:7.1f}{'' if label == 'samples' else ' %'}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
