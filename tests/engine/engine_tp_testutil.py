"""Run a TP group of spawned processes on loopback (gloo) for the engine TP tests."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable

from pdserve.ports import free_port


def _entry(fn: Callable, rank: int, size: int, port: int, timeout_s: float, args: tuple,
           results: mp.Queue) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers  # noqa: F401  (rank 0 loads a tokenizer: import before the clock runs)

    from engine.tp import init_tp
    torch.set_num_threads(1)
    try:
        tp = init_tp(rank, size, "127.0.0.1", port, "gloo", timeout_s, connect_timeout_s=120.0)
        results.put((rank, "ok", fn(tp, *args)))
    except BaseException as e:  # reported to the parent, which fails the test with it
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def run_group(fn: Callable, size: int, *args, timeout_s: float = 60.0, wait_s: float = 300.0,
              expect: list[int] | None = None) -> dict[int, tuple[str, object]]:
    """Spawn `size` ranks that each call fn(tp, *args); return rank -> ("ok", value) or
    ("error", traceback) for the ranks in `expect` (default: all). fn must be importable
    (module level) and its value picklable."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, size, port, timeout_s, args, results),
                         daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    expect = list(range(size)) if expect is None else expect
    try:
        while len(out) < len(expect):
            try:
                rank, status, value = results.get(timeout=wait_s)
            except queue.Empty:
                raise TimeoutError(f"TP group: ranks {sorted(set(expect) - set(out))} "
                                   f"did not report within {wait_s} s") from None
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return out
