"""``python -m ctx_worker --config FILE [--index N]``: run one context (prefill) server."""

import sys

from ctx_worker.context_phase import setup_ctx_role
from executor.server_main import main

if __name__ == "__main__":
    sys.exit(main("ctx", setup_ctx_role))
