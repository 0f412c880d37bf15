"""The suite's shared fixtures, and the rules that keep `make test` fast (< 12 min on 2 cores).

Where the shared fixtures live (use them before writing a new one; each start of a real server
costs seconds of the suite's time):

| fixture | scope | defined in | what |
|---|---|---|---|
| ``tiny_model_dir`` | session | here | the tiny random Llama (seed 0, SmolLM2 tokenizer) as an HF directory; every real-process and in-process cluster test uses it |
| ``procs`` | module | tests/integration/conftest.py | :class:`tests.integration.procs.Procs`: processes a module starts, stopped by PID at its end |
| ``session_procs`` | session | tests/integration/conftest.py | the same for processes shared by several modules (``tiny_cluster``) |
| ``tiny_cluster`` | session | tests/integration/conftest.py | 1 ctx + 1 gen (MPI lattice) + orchestrator as real processes, shared by every module that only sends requests: do not kill, scale or reconfigure it (start your own :class:`~tests.integration.procs.Cluster` for that) |
| ``genfirst_url`` | session | tests/integration/conftest.py | a second orchestrator (``generation_first``) over ``tiny_cluster``'s servers |
| ``threaded_cluster`` | module | tests/integration/conftest.py | ctx + gen (inproc engines) + orchestrator as uvicorn threads in the test process: starts in about a second; the first choice for API-surface tests |
| ``inproc_cluster`` | package | tests/fuzz/conftest.py | the apps in process (ASGI, no sockets): the fuzz |
| ``launched`` / ``launch_cluster`` | module / helper | tests/control_plane/conftest.py | an orchestrator that launches its own servers (``launcher.kind: local``): scaling, restarts, chaos |
| ``smollm2_engine``, ``hf_smollm2``, ``tiny_dir``, ``tiny_engine`` | session | tests/engine/conftest.py | engines in process (SmolLM2 and tiny) and the HF reference |
| fake ctx/gen servers | function | tests/orchestrator/conftest.py | orchestrator tests without engines |

Rules (the suite runs under pytest-xdist, ``-n 2 --dist loadfile``, see pyproject.toml):

- A file's tests run on one worker, in file order, so module-scoped fixtures are shared as
  written; a module must not depend on another module's state or order. Session fixtures are
  built once per worker that uses them.
- Files are handed out longest first (``COST_S`` in tests/xdist_plan.py), so both workers finish
  together: a new file that takes more than ~10 s goes into ``COST_S``. Files that share an
  expensive session fixture (``tiny_cluster``, ``smollm2_engine``, ``family_dirs``) form one unit
  there (``SHARED``) and run on one worker, which builds that fixture once: a new user of one of
  them joins its group.
- Ports come from :func:`tests.integration.procs.free_port` or ``port: 0``; files and IPC paths
  from ``tmp_path``/``tmp_path_factory`` (never a fixed name: two workers run at once).
- A time bound in a test is relative to something measured in the same test (a cold start, the
  same request alone) plus slack, or generous enough for a loaded machine: never a sleep that
  hopes the other side is done; poll with a deadline instead.
- Keep a real-process cluster per module, not per test, unless the test kills or scales it;
  test topologies use short poll intervals (``health_interval_s`` 0.2, ``monitor_interval_s``
  0.2) and ``num_threads: 1``.
- Real-model (SmolLM2) tests are few and marked ``slow``.
"""

from __future__ import annotations

import os

# OpenMP workers spin while waiting by default; on a shared, loaded machine that makes every op
# several times slower. Must precede the first `import torch` (in this process and in the
# servers the tests start, which inherit it), so it is set here, before any test module loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests import xdist_plan  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Longest files first (tests/xdist_plan.py: the two workers then finish together)."""
    xdist_plan.order_items(items)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with tests/xdist_plan.py's units and order (xdist's own otherwise)."""
    return xdist_plan.make_scheduler(config, log)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Path of the tiny random-weight Llama HF directory (``engine.tiny.make_tiny_llama``, seed 0:
    2 layers, hidden 64, 4 heads / 2 KV heads of 16, the SmolLM2 tokenizer, 49,152 tokens),
    written once per session (per xdist worker)."""
    from engine.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)
