"""``python -m orchestrator.worker_main``: one worker of an orchestrator group (started by the
owner only; see :mod:`orchestrator.process_group`)."""

from __future__ import annotations

import sys

from .group_main import run_worker

if __name__ == "__main__":
    sys.exit(run_worker())
