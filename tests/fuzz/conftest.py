"""Fixtures: one in-process tiny cluster (ctx + gen + orchestrator apps) shared by the fuzz tests."""

from __future__ import annotations

import pytest

from tests.fuzz.inproc import InProcessCluster


@pytest.fixture(scope="session")
def fuzz_model_dir(tmp_path_factory):
    from engine.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("fuzz-tiny"), seed=0)


@pytest.fixture(scope="package")  # shared by tests/fuzz/*, stopped after them
def inproc_cluster(fuzz_model_dir, tmp_path_factory):
    cluster = InProcessCluster.start(fuzz_model_dir, tmp_path_factory.mktemp("fuzz-cluster"))
    yield cluster
    cluster.close()
