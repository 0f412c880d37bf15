"""Fixtures that start real ctx/gen servers and the orchestrator on 127.0.0.1."""

from __future__ import annotations

import pytest
import yaml

from tests.integration.procs import Cluster, Procs, free_port, write_topology

TINY_NAME = "tiny-llama"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from engine.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    p = Procs(tmp_path_factory.mktemp("logs"))
    yield p
    p.stop_all()


@pytest.fixture(scope="module")
def tiny_cluster(tiny_model_dir, procs, tmp_path_factory) -> Cluster:
    """1 ctx + 1 gen (tiny random Llama, block_size 4) + orchestrator."""
    topo = write_topology(tmp_path_factory.mktemp("topo") / "tiny.yaml", str(tiny_model_dir), TINY_NAME)
    return Cluster(topo, procs).start()


@pytest.fixture(scope="module")
def threaded_cluster(tiny_model_dir, tmp_path_factory):
    """1 ctx + 1 gen + orchestrator in this process (inproc engines, real sockets): see threaded_cluster.py."""
    from tests.integration.threaded_cluster import ThreadedCluster

    cluster = ThreadedCluster.start(tiny_model_dir, tmp_path_factory.mktemp("threaded"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def genfirst_url(tiny_cluster, procs, tmp_path_factory) -> str:
    """A second orchestrator over ``tiny_cluster``'s servers with ``schedule_style: generation_first``
    (the same servers, so both styles are compared on the same engines)."""
    doc = {**tiny_cluster.doc, "orchestrator": {**tiny_cluster.doc["orchestrator"], "port": free_port(),
                                                "schedule_style": "generation_first"}}
    path = tmp_path_factory.mktemp("topo") / "tiny-genfirst.yaml"
    path.write_text(yaml.safe_dump(doc))
    url = f"http://127.0.0.1:{doc['orchestrator']['port']}"
    procs.start("orchestrator-genfirst", "-m", "orchestrator", "--config", str(path))
    procs.wait_healthy("orchestrator-genfirst", url)
    return url
