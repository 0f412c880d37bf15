"""``python -m ctx_worker --config FILE [--index N]``: run one context (prefill) server."""

import sys

from executor.server_main import main

if __name__ == "__main__":
    sys.exit(main("ctx"))
