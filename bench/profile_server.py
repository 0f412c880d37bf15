"""Profile one real server (HTTP frontend + lattice rank 0 over IPC) with py-spy under load.

    .venv/bin/python bench/profile_server.py [--dtype float32] [--threads 2] [--requests 8]

Starts one ctx server (``python -m ctx_worker``, the default MPI lattice; requests without
``disaggregated_params`` run colocated), then for each case runs ``py-spy record -f raw
--subprocesses`` on the server's process tree while ``pdserve bench`` drives it (streaming
``/v1/completions``, token-id prompts, ``--ignore-eos``): c1 decode (128 in / 64 out,
concurrency 1), c8 decode (the same at concurrency 8) and a 512-token prefill (512 in / 1 out).
Writes ``bench/results/profile/<case>.txt`` (raw py-spy stacks) and prints the breakdown of
each case per process (``bench/profile_breakdown.py --by-process``). py-spy must be installed
(``.venv/bin/pip install py-spy``); it needs ptrace rights over the server (root, or the same
user with ``kernel.yama.ptrace_scope`` 0).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import PY, RESULTS, ROOT, Procs, bench, loadavg, say, server_url, write_topology  # noqa: E402

CASES = {"c1_decode": (128, 64, 1), "c8_decode": (128, 64, 8), "prefill_512": (512, 1, 1)}


def bench_args(url: str, input_len: int, output_len: int, conc: int, n: int) -> list[str]:
    return ["--base-url", url, "--model", "SmolLM2-135M-Instruct", "--workload", "random",
            "--input-len", str(input_len), "--output-len", str(output_len), "--range-ratio", "0",
            "--ignore-eos", "--num-prompts", str(n), "--max-concurrency", str(conc),
            "--request-rate", "inf", "--num-warmups", "0", "--max-duration", "240",
            "--disable-tqdm"]


def profile_case(pid: int, url: str, case: str, a: argparse.Namespace, out_dir: Path) -> Path:
    """Record py-spy over the server tree while one bench run drives it; the raw file."""
    input_len, output_len, conc = CASES[case]
    raw = out_dir / f"{case}.txt"
    spy = subprocess.Popen([a.py_spy, "record", "-f", "raw", "-r", str(a.rate), "--subprocesses",
                            "-d", str(a.max_seconds), "-o", str(raw), "--pid", str(pid)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        n = conc * a.requests if output_len > 1 else a.requests
        doc = bench(bench_args(url, input_len, output_len, conc, n))
        m = doc["runs"][0]["metrics"]
        say(f"{case}: {m['output_throughput']:.1f} tok/s, TTFT {m['ttft_ms']}, TPOT {m['tpot_ms']}, "
            f"failed {m['failed']}, load {loadavg():.1f}")
    finally:
        spy.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
        try:
            spy.wait(30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait(5)
    return raw


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency slot")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    p.add_argument("--max-seconds", type=int, default=300, help="py-spy's own time bound")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--py-spy", default=shutil.which("py-spy") or str(Path(PY).parent / "py-spy"))
    a = p.parse_args()
    out_dir = RESULTS / "profile"
    out_dir.mkdir(parents=True, exist_ok=True)
    topo = out_dir / "server.yaml"
    doc = write_topology(topo, engine={"num_threads": a.threads, "dtype": a.dtype})
    url = server_url(doc, "ctx")
    say(f"load average at start: {loadavg():.2f}")
    with Procs(out_dir / "logs") as procs:
        server = procs.start("server", [PY, "-m", "ctx_worker", "--config", str(topo), "--index", "0"])
        procs.wait_http("server", url + "/health", 300)
        bench(bench_args(url, 128, 8, 1, 2))  # warm-up, not profiled
        raws = [profile_case(server.pid, url, case, a, out_dir) for case in a.cases]
    for raw in raws:
        print(f"\n===== {raw.stem} ({raw})", flush=True)
        subprocess.run([PY, str(ROOT / "bench" / "profile_breakdown.py"), str(raw), "--by-process",
                        "--busy-only", "--top", "8"], check=False)
    say(f"load average at end: {loadavg():.2f}")


if __name__ == "__main__":
    main()
