"""``python -m gen_worker --config FILE [--index N]``: run one generation (decode) server."""

import sys

from executor.server_main import main
from gen_worker.generation_phase import setup_gen_role

if __name__ == "__main__":
    sys.exit(main("gen", setup_gen_role))
