"""Shared plumbing of the experiment scripts in bench/: processes pinned with taskset, topology
files, in-process ``pdserve bench`` runs, and the marked sections of docs/benchmarks.md.

Every process started here is stopped by its own PID (SIGTERM to its process group, then SIGKILL).
"""

from __future__ import annotations

import asyncio
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from pdbench.cli import build_parser, run_sweep  # noqa: E402
from pdserve.ports import free_port  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "bench" / "results"   # gitignored: raw JSON of every run
FIGURES = ROOT / "docs" / "figures"    # committed PNGs referenced from docs/benchmarks.md
PY = sys.executable


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Procs:
    """Child processes of one experiment; logs under ``log_dir``."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], cores: str | None = None, env: dict | None = None) -> subprocess.Popen:
        """Start ``argv`` (pinned to ``cores``, e.g. "0" or "0,1", with taskset) in its own session."""
        full = (["taskset", "-c", cores] if cores else []) + argv
        child_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
                     **(env or {})}
        with open(self.log_dir / f"{name}.log", "wb") as log:
            log.write(f"$ {shlex.join(full)}\n".encode())
            log.flush()
            proc = subprocess.Popen(full, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, n: int = 30) -> str:
        try:
            return "\n".join((self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def wait_http(self, name: str, url: str, timeout_s: float = 180.0) -> None:
        """Poll ``url`` until it answers 200. Raises RuntimeError with the log tail."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited ({self.procs[name].returncode}):\n{self.log_tail(name)}")
            try:
                if httpx.get(url, timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{name} not ready at {url} after {timeout_s:g} s:\n{self.log_tail(name)}")

    def stop(self, name: str, grace_s: float = 10.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(5)

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)

    def __enter__(self) -> "Procs":
        def _terminate(signum, frame):  # SIGTERM/SIGINT (even when started in the background) -> cleanup
            raise KeyboardInterrupt(f"signal {signum}")

        signal.signal(signal.SIGTERM, _terminate)
        signal.signal(signal.SIGINT, _terminate)
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, ``/proc/PID/stat`` fields 14-15) used so far by ``pid`` and every
    live descendant: a router's own cost, independent of how loaded the machine is. A process that
    exited meanwhile is not counted (measure around runs in which none exits)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu seconds)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo.extend(c for c, (ppid, _) in stats.items() if ppid == p)
    return total


def write_topology(path: Path, *, model_path: str = "smollm2", model_name: str = "SmolLM2-135M-Instruct",
                   engine: dict | None = None, ctx_engine: dict | None = None, gen_engine: dict | None = None,
                   num_ctx: int = 1, num_gen: int = 1) -> dict:
    """A topology YAML on free ports; returns the document."""
    doc = {
        "model": {"path": model_path, "name": model_name},
        "engine": {"dtype": "float32", "block_size": 16, "num_kv_blocks": 512, "max_batch_size": 16,
                   "max_num_tokens": 2048, **(engine or {})},
        "kv_transfer": {"backend": "tcp", "lease_ms": 60000, "timeout_ms": 30000},
        "orchestrator": {"host": "127.0.0.1", "port": free_port(), "health_interval_s": 0.5,
                         "startup_timeout_s": 180, "request_timeout_s": 900},
        "pools": {
            "ctx": {"engine": ctx_engine or {}, "servers": [{"host": "127.0.0.1", "port": free_port()}
                                                             for _ in range(num_ctx)]},
            "gen": {"engine": gen_engine or {}, "servers": [{"host": "127.0.0.1", "port": free_port()}
                                                             for _ in range(num_gen)]},
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return doc


def server_url(doc: dict, role: str, i: int = 0) -> str:
    s = doc["pools"][role]["servers"][i]
    return f"http://{s['host']}:{s['port']}"


def orchestrator_url(doc: dict) -> str:
    o = doc["orchestrator"]
    return f"http://{o['host']}:{o['port']}"


def bench(argv: list[str]) -> dict:
    """Run ``pdserve bench ARGV`` in this process (tables printed) and return its result document."""
    args = build_parser().parse_args(argv)
    return asyncio.run(run_sweep(args))


def median(xs: list[float]) -> float:
    xs = sorted(x for x in xs if x is not None and x == x)  # skip None and NaN (a run where all failed)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def machine_description() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    try:
        import torch

        tv = torch.__version__
    except ImportError:
        tv = "n/a"
    return (f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem_gib:.0f} GiB RAM, no GPU; "
            f"Linux {platform.release()}, Python {platform.python_version()}, torch {tv}")


def loadavg() -> float:
    """The 1-minute load average (other jobs on these cores make every number noisier)."""
    return os.getloadavg()[0]


def cpu_jiffies(stat: Path = Path("/proc/stat")) -> list[int]:
    """The machine-wide ``cpu`` line of /proc/stat (jiffies: user nice system idle iowait irq softirq
    steal ...); [] where there is none (not Linux)."""
    try:
        line = stat.read_text().splitlines()[0]
    except (OSError, IndexError):
        return []
    return [int(x) for x in line.split()[1:]] if line.startswith("cpu ") else []


def steal_share(before: list[int], after: list[int]) -> float | None:
    """The share (0..1) of the CPU time between two :func:`cpu_jiffies` readings that the hypervisor
    gave to other guests ("steal", proc(5)): time this VM's cores were not running at all, which no
    load average shows. None without two readings that carry the steal column."""
    if len(before) < 8 or len(after) < 8:
        return None
    delta = [b - a for a, b in zip(before, after)]
    total = sum(delta[:8])  # guest time is already counted in user/nice
    return delta[7] / total if total > 0 else None


def conditions(load_before: float) -> str:
    """One line for docs/benchmarks.md: machine and how busy it was."""
    return (f"Machine: {machine_description()}. 1-min load average {load_before:.1f} at the start, "
            f"{loadavg():.1f} at the end (> 2 means other jobs were competing for the two cores).")


def update_section(name: str, body: str, doc_path: Path = DOC) -> None:
    """Replace the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` (append if absent)."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = doc_path.read_text() if doc_path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    doc_path.parent.mkdir(parents=True, exist_ok=True)
    doc_path.write_text(text)
    say(f"updated section {name!r} of {doc_path.relative_to(ROOT)}")


def md_table(header: list[str], rows: list[list]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
