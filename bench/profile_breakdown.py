"""Where the time goes: bucket py-spy samples (``py-spy record -f raw``) by engine/server stage.

    py-spy record -f raw -r 100 -o prof.txt [--subprocesses] -- python bench/engine_step.py ...
    .venv/bin/python bench/profile_breakdown.py prof.txt [--by-process] [--top 15]

Each raw line is ``frame;frame;...;frame COUNT`` (outermost first), a frame ``func (file:line)``.
A sample is charged to the innermost frame that a rule below matches (file suffix and function
names), else to "other python" or, when no frame names a project file, to "idle/runtime"; a stack
whose innermost frame waits (Condition.wait, zmq poll, select, ...) is "waiting (idle threads)".
Stacks are keyed by the innermost ``process PID:"argv"`` frame (``--subprocesses``). Prints one table of shares per process (``--by-process``,
needs ``--subprocesses`` samples) or for all samples together, plus the top innermost frames.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

# (category, file suffix, function names or None for any) — first match wins per frame.
RULES: list[tuple[str, str, set[str] | None]] = [
    ("sampling", "engine/sampler.py", None),
    ("sampling", "engine/counter_rng.py", None),
    ("attention gathers", "engine/attention.py", {"_gather", "_gather_decode"}),
    ("attention KV write", "engine/attention.py", {"write_kv"}),
    ("attention SDPA", "engine/attention.py", None),
    ("RoPE", "engine/layers.py", {"apply_rope", "rope_cos_sin", "lookup", "reserve", "_build"}),
    ("model math", "engine/layers.py", None),
    ("model math", "engine/model.py", None),
    ("plan + metadata", "engine/model_runner.py", None),
    ("plan + metadata", "engine/attention_metadata.py", None),
    ("detokenize + stops", "engine/detokenizer.py", None),
    ("detokenize + stops", "engine/output_processor.py", None),
    ("detokenize + stops", "engine/stop_checker.py", None),
    ("detokenize + stops", "tokenizers/", None),
    ("model loading (not a step)", "engine/loader.py", None),
    ("model loading (not a step)", "engine/gguf_", None),
    ("model loading (not a step)", "engine/tokenizer.py", None),
    ("model loading (not a step)", "engine/kv_memory.py", None),
    ("scheduler + blocks", "engine/scheduler.py", None),
    ("scheduler + blocks", "engine/block_manager.py", None),
    ("engine step (rest)", "engine/llm_engine.py", {"step", "_apply_token", "_finish",
                                                    "_drain_outputs", "has_work"}),
    ("model loading (not a step)", "engine/llm_engine.py", {"__init__"}),
    ("IPC", "executor/ipc.py", None),
    ("IPC", "zmq/", None),
    ("IPC", "executor/lattice_client.py", None),
    ("IPC", "executor/worker_loop.py", None),
    ("HTTP/SSE", "executor/http_server.py", None),
    ("HTTP/SSE", "executor/openai_adapter.py", None),
    ("HTTP/SSE", "pdserve/protocol.py", None),
    ("HTTP/SSE", "pydantic", None),
    ("HTTP/SSE", "starlette/", None),
    ("HTTP/SSE", "fastapi/", None),
    ("HTTP/SSE", "uvicorn/", None),
    ("HTTP/SSE", "h11/", None),
    ("HTTP/SSE", "httptools/", None),
]
PROJECT = ("engine/", "executor/", "ctx_worker/", "gen_worker/", "pdserve/", "bench/")
# Innermost frames of threads that wait (py-spy may sample them as active on a loaded machine).
WAITS = {"wait", "poll", "select", "_try_wait", "sleep", "recv", "recv_multipart", "accept",
         "_recv_into", "get", "acquire", "run_forever", "_run_once", "epoll"}
WAIT_FRAMES = {("Runner.run", "asyncio/runners.py"), ("RankMonitor._run", "executor/monitor.py")}
WAIT = "waiting (idle threads)"
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^:()]+)(?::\d+)?\)$")


def categorize(frames: list[str]) -> str:
    """The category of one stack (outermost first)."""
    inner = FRAME.match(frames[-1].strip()) if frames else None
    if inner and (inner.group("func").rpartition(".")[2] in WAITS or any(
            inner.group("func") == f and inner.group("file").endswith(p) for f, p in WAIT_FRAMES)):
        return WAIT  # a native wait under a Python frame: the event loop's epoll, the pidfd poll
    seen_project = False
    for frame in reversed(frames):
        m = FRAME.match(frame.strip())
        if not m:
            continue
        func, file = m.group("func").rpartition(".")[2], m.group("file")
        for cat, suffix, funcs in RULES:
            if suffix in file and (funcs is None or func in funcs):
                return cat
        seen_project = seen_project or any(p in file for p in PROJECT)
    return "other python" if seen_project else "idle/runtime"


def _process_name(frame: str) -> str:
    """'process 12:"python -m executor.worker_main --x"' -> 'executor.worker_main (pid 12)'."""
    m = re.match(r'process (\d+):"(.*)"$', frame)
    if not m:
        return frame
    argv = m.group(2).split()
    name = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else Path(argv[0]).name
    return f"{name} (pid {m.group(1)})"


def parse(path: Path, by_process: bool) -> tuple[dict[str, Counter], Counter]:
    """(process -> category -> samples, innermost frame -> samples)."""
    shares: dict[str, Counter] = defaultdict(Counter)
    inner: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [i for i, f in enumerate(frames) if f.startswith("process ")]
        proc = "all"
        if procs:
            proc = _process_name(frames[procs[-1]]) if by_process else "all"
            frames = frames[procs[-1] + 1:]
        shares[proc][categorize(frames)] += int(count)
        inner[frames[-1]] += int(count)
    return shares, inner


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("raw", type=Path)
    p.add_argument("--by-process", action="store_true")
    p.add_argument("--busy-only", action="store_true",
                   help="leave waiting threads and runtime-only stacks out")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    shares, inner = parse(a.raw, a.by_process)
    for proc, counts in shares.items():
        if a.busy_only:
            counts.pop("idle/runtime", None)
            counts.pop(WAIT, None)
        total = sum(counts.values()) or 1
        print(f"\n{proc}: {total} samples\n| stage | share |\n|---|---:|")
        for cat, n in counts.most_common():
            print(f"| {cat} | {100 * n / total:.1f}% |")
    print("\ntop innermost frames:")
    for frame, n in inner.most_common(a.top):
        print(f"{n:7d}  {frame}")


if __name__ == "__main__":
    main()
