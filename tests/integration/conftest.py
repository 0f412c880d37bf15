"""Fixtures that start real ctx/gen servers and the orchestrator on 127.0.0.1 (the whole map of
shared fixtures: tests/conftest.py)."""

from __future__ import annotations

import pytest
import yaml

from tests.integration.procs import Cluster, Procs, free_port, write_topology

TINY_NAME = "tiny-llama"


def __getattr__(name: str):
    # `from tests.integration.conftest import tiny_model_dir` (the fixture lived here before it moved
    # to tests/conftest.py) keeps working; a module __getattr__ is not in dir(), so pytest does not
    # register the fixture a second time here.
    if name == "tiny_model_dir":
        from tests.conftest import tiny_model_dir

        return tiny_model_dir
    raise AttributeError(name)


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    """:class:`Procs` of one module: what it starts is stopped (by PID) when the module ends."""
    p = Procs(tmp_path_factory.mktemp("logs"))
    yield p
    p.stop_all()


@pytest.fixture(scope="session")
def session_procs(tmp_path_factory):
    """:class:`Procs` whose processes several modules share (``tiny_cluster``); stopped at the end
    of the session (of the xdist worker)."""
    p = Procs(tmp_path_factory.mktemp("session-logs"))
    yield p
    p.stop_all()


@pytest.fixture(scope="session")
def tiny_cluster(tiny_model_dir, session_procs, tmp_path_factory) -> Cluster:
    """1 ctx + 1 gen (tiny random Llama, block_size 4, MPI lattice) + orchestrator, started once and
    shared by every module that only sends it requests. Do not kill, scale, drain or reset it: a
    test that does starts its own :class:`Cluster` (with the module's ``procs``)."""
    topo = write_topology(tmp_path_factory.mktemp("topo") / "tiny.yaml", str(tiny_model_dir), TINY_NAME)
    return Cluster(topo, session_procs).start()


@pytest.fixture(scope="module")
def threaded_cluster(tiny_model_dir, tmp_path_factory):
    """1 ctx + 1 gen + orchestrator in this process (inproc engines, real sockets): see threaded_cluster.py."""
    from tests.integration.threaded_cluster import ThreadedCluster

    cluster = ThreadedCluster.start(tiny_model_dir, tmp_path_factory.mktemp("threaded"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def genfirst_url(tiny_cluster, session_procs, tmp_path_factory) -> str:
    """A second orchestrator over ``tiny_cluster``'s servers with ``schedule_style: generation_first``
    (the same servers, so both styles are compared on the same engines)."""
    doc = {**tiny_cluster.doc, "orchestrator": {**tiny_cluster.doc["orchestrator"], "port": free_port(),
                                                "schedule_style": "generation_first"}}
    path = tmp_path_factory.mktemp("topo") / "tiny-genfirst.yaml"
    path.write_text(yaml.safe_dump(doc))
    url = f"http://127.0.0.1:{doc['orchestrator']['port']}"
    session_procs.start("orchestrator-genfirst", "-m", "orchestrator", "--config", str(path))
    session_procs.wait_healthy("orchestrator-genfirst", url)
    return url
