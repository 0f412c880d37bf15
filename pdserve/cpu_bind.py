"""``engine.cpu_bind``: which cores a worker rank's torch (OpenMP) threads are pinned to, one per core.

Values: ``"off"`` (the kernel places the threads, as before), ``"auto"`` (the default) or a CPU
list (``"0-1"``, ``"0,2"``, ``"0-3,8-11"``) naming ``tp_size × threads`` cores; rank r of the
server takes the r-th slice of ``threads`` cores, so TP ranks on one host get disjoint cores.

``auto`` pins only when this server was given its cores explicitly: the process's affinity mask
(set by ``taskset``, a launcher, Slurm's CPU binding or a cpuset) is narrower than the host's
online CPUs and holds exactly ``tp_size × num_threads`` cores (``num_threads`` set); the ranks then
split that mask. Servers started side by side without a mask (``make serve``: a ctx and a gen
server on the same cores) or under one shared mask larger than each needs are not pinned, so two
servers are never pinned to the same core by accident.

Pure Python (no torch): the topology schema validates with it and the ranks plan with it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path

MODES = ("auto", "off")


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``"0-1,4"`` → ``(0, 1, 4)``: sorted, without repeats (Linux's cpulist format, as ``taskset -c``).
    Raises ValueError naming the bad part."""
    cores: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a core number or a range a-b") from None
        if first < 0 or last < first:
            raise ValueError(f"bad CPU list {text!r}: {part!r} is not a range of core numbers a-b with 0 <= a <= b")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def check_setting(value: str, tp_size: int, num_threads: int | None) -> str:
    """``value`` itself if it is a valid ``engine.cpu_bind`` for ``tp_size`` ranks of ``num_threads``
    threads each (None: as many as the list gives each rank). Raises ValueError."""
    if value in MODES:
        return value
    cores = parse_cpu_list(value)
    if num_threads is not None and len(cores) != tp_size * num_threads:
        raise ValueError(f"cpu_bind {value!r} names {len(cores)} core(s); tp_size {tp_size} × num_threads "
                         f"{num_threads} needs exactly {tp_size * num_threads} (one per torch thread)")
    if len(cores) % tp_size:
        raise ValueError(f"cpu_bind {value!r} names {len(cores)} core(s), which do not split evenly over "
                         f"tp_size {tp_size} ranks")
    return value


@dataclass(frozen=True)
class RankCores:
    """What one rank does: ``cores`` (thread i of its OpenMP team on ``cores[i]``; empty: no pinning),
    ``threads`` (its torch thread count; None: torch's default) and ``reason`` (for the log)."""

    cores: tuple[int, ...]
    threads: int | None
    reason: str


def online_cpus() -> int:
    """How many CPUs the host has online (``/sys/devices/system/cpu/online``; else ``os.cpu_count``)."""
    try:
        return len(parse_cpu_list(Path("/sys/devices/system/cpu/online").read_text().strip()))
    except (OSError, ValueError):
        return os.cpu_count() or 1


def plan_rank(setting: str, num_threads: int | None, tp_size: int, rank: int,
              allowed: set[int], host_cpus: int) -> RankCores:
    """The cores of TP rank ``rank`` under ``setting`` (validated by :func:`check_setting`), given the
    process's affinity mask ``allowed`` and the host's online CPU count.

    Raises ValueError when an explicit list names a core outside ``allowed`` (the rank could not
    run there: a taskset, Slurm or cpuset mask forbids it)."""
    if setting == "off":
        return RankCores((), num_threads, "engine.cpu_bind: off")
    if setting == "auto":
        mask = sorted(allowed)
        if len(mask) >= host_cpus:
            return RankCores((), num_threads, f"engine.cpu_bind: auto, not pinned: the process may run on all "
                             f"{host_cpus} CPUs of the host (no taskset/launcher/Slurm mask gave it its cores)")
        if num_threads is None or len(mask) != tp_size * num_threads:
            return RankCores((), num_threads, f"engine.cpu_bind: auto, not pinned: the mask {fmt(mask)} is not "
                             f"exactly tp_size {tp_size} × num_threads {num_threads} cores (a mask shared with "
                             "other servers must not pin them all to its first cores)")
        cores = tuple(mask[rank * num_threads:(rank + 1) * num_threads])
        return RankCores(cores, num_threads, f"engine.cpu_bind: auto → cores {fmt(cores)} (the process's mask)")
    listed = parse_cpu_list(setting)
    outside = sorted(set(listed) - allowed)
    if outside:
        raise ValueError(f"engine.cpu_bind {setting!r}: core(s) {fmt(outside)} are outside this process's "
                         f"affinity mask {fmt(sorted(allowed))} (taskset, Slurm or a cpuset forbids them)")
    per_rank = len(listed) // tp_size
    cores = listed[rank * per_rank:(rank + 1) * per_rank]
    return RankCores(cores, per_rank, f"engine.cpu_bind: {setting} → rank {rank} on cores {fmt(cores)}")


def fmt(cores) -> str:
    """``(0, 1, 2, 5)`` → ``"0-2,5"``."""
    runs = [[c for _, c in group] for _, group in groupby(enumerate(sorted(set(cores))), lambda ic: ic[1] - ic[0])]
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def omp_env(cores: tuple[int, ...]) -> dict[str, str]:
    """The OpenMP environment that pins a team's thread i to ``cores[i]`` (read once, when the
    OpenMP runtime loads: set it before ``import torch``). Empty for no cores."""
    if not cores:
        return {}
    return {"OMP_PLACES": ",".join(f"{{{c}}}" for c in cores), "OMP_PROC_BIND": "close",
            "OMP_NUM_THREADS": str(len(cores))}


SPIN_COUNT = 10000  # libgomp busy-wait iterations before an idle thread sleeps (tens of µs)
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def omp_wait_env(setting: str, pinned: bool, environ: dict[str, str]) -> tuple[dict[str, str], str]:
    """The OpenMP wait environment of a worker rank under ``engine.openmp_wait`` (``setting``:
    ``auto``, ``passive`` or ``spin``) and the reason, for the log. Like :func:`omp_env` it must be in
    ``os.environ`` before ``import torch``.

    Between two parallel regions an idle libgomp thread spins ``GOMP_SPINCOUNT`` iterations, then
    sleeps on a futex; a decode step runs ~1,200 short regions, so a thread that sleeps at once
    (``OMP_WAIT_POLICY=PASSIVE``) is woken ~1,200 times a step. Measured (SmolLM2 fp32, 2 threads,
    idle AMD EPYC, ``bench/engine_step.py``): passive 30.7 / 46.1 ms per b1 / b8 step, spin 10000
    23.2 / 35.2 ms; on cores shared with other busy processes spinning steals their CPU, so
    passive is the safe choice there. ``auto``: ``spin`` when ``pinned`` (the rank's threads have
    cores of their own), else ``passive``; an ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` already
    in ``environ`` (the operator's own choice) is kept. Returns the variables to set (GOMP_SPINCOUNT
    takes precedence over OMP_WAIT_POLICY in libgomp, so ``spin`` sets only that one)."""
    if setting == "auto":
        given = {k: environ[k] for k in _WAIT_VARS if k in environ}
        if given:
            return {}, "engine.openmp_wait: auto, kept the environment's " + ", ".join(
                f"{k}={v}" for k, v in given.items())
        setting = "spin" if pinned else "passive"
        why = "threads pinned to cores of their own" if pinned else "threads not pinned (cores may be shared)"
    else:
        why = "set"
    if setting == "spin":
        return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}, f"engine.openmp_wait: spin (GOMP_SPINCOUNT={SPIN_COUNT}; {why})"
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"}, f"engine.openmp_wait: passive ({why})"
