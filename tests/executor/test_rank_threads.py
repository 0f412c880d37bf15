"""The rank's side of ``engine.cpu_bind`` before torch loads (executor.worker_main.plan_threads)."""

from __future__ import annotations

import os

import pytest

from executor import worker_main
from pdserve.config import EngineSettings
from pdserve.cpu_bind import online_cpus


def spec(**engine) -> dict:
    return {"server": {"engine": EngineSettings(**engine).model_dump(mode="json")}}


def test_a_core_outside_the_mask_is_a_start_up_error_not_a_crash(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    plan, err = worker_main.plan_threads(spec(cpu_bind="1", num_threads=1))
    assert plan.cores == () and isinstance(err, ValueError)
    assert "engine.cpu_bind '1': core(s) 1 are outside this process's affinity mask 0" in str(err)


def test_binding_after_torch_loaded_is_refused(monkeypatch):
    import torch  # noqa: F401 - loaded: its OpenMP runtime has read its environment already

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.setattr(os, "environ", dict(os.environ))
    before = dict(os.environ)
    plan, err = worker_main.plan_threads(spec(cpu_bind="0", num_threads=1))
    assert isinstance(err, RuntimeError) and "torch was imported before" in str(err)
    assert plan.cores == () and os.environ == before


@pytest.mark.parametrize("bind", ["off", "auto"])
def test_no_binding_sets_nothing(monkeypatch, bind):
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(online_cpus())))  # auto: the whole host
    before = dict(os.environ)
    plan, err = worker_main.plan_threads(spec(cpu_bind=bind, num_threads=2))
    assert err is None and plan.cores == () and os.environ == before


def test_a_pinned_rank_spins_and_an_unpinned_one_sleeps(monkeypatch):
    """engine.openmp_wait auto: the rank's own plan decides (no wait variable inherited)."""
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(online_cpus())))
    plan, err = worker_main.plan_threads(spec(cpu_bind="off", num_threads=2))
    assert err is None and os.environ["OMP_WAIT_POLICY"] == "PASSIVE" and os.environ["GOMP_SPINCOUNT"] == "0"
    assert "engine.openmp_wait: passive" in plan.reason
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY",
                                                                                         "GOMP_SPINCOUNT")})
    plan, err = worker_main.plan_threads(spec(cpu_bind="off", num_threads=2, openmp_wait="spin"))
    assert err is None and os.environ["GOMP_SPINCOUNT"] == "10000" and "OMP_WAIT_POLICY" not in os.environ
