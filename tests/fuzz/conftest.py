"""Fixtures: one in-process tiny cluster (ctx + gen + orchestrator apps) shared by the fuzz tests."""

from __future__ import annotations

import pytest

from tests.fuzz.inproc import InProcessCluster


@pytest.fixture(scope="package")  # shared by tests/fuzz/*, stopped after them
def inproc_cluster(tiny_model_dir, tmp_path_factory):
    cluster = InProcessCluster.start(tiny_model_dir, tmp_path_factory.mktemp("fuzz-cluster"))
    yield cluster
    cluster.close()
