"""``python -m gen_worker --config FILE [--index N]``: run one generation (decode) server."""

import sys

from executor.server_main import main

if __name__ == "__main__":
    sys.exit(main("gen"))
