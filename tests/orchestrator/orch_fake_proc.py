"""A fake ctx/gen server as a process (for launcher tests): ``python orch_fake_proc.py --role ctx --port P``."""

from __future__ import annotations

import argparse
import sys

import uvicorn

from orch_fakes import Behavior, Record, make_fake_server


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["ctx", "gen"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--exit-code", type=int, default=None, help="print a line and exit with this code")
    args = parser.parse_args()
    if args.exit_code is not None:
        print(f"fake {args.role}: boom, exiting with {args.exit_code}", flush=True)
        return args.exit_code
    uvicorn.run(make_fake_server(args.role, Behavior(), Record()), host="127.0.0.1", port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
