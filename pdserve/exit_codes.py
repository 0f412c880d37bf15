"""Exit statuses of a ctx/gen server (``python -m ctx_worker`` / ``gen_worker``), shared by the
servers and the launchers that restart them (torch-free).

| status | meaning | a launcher should |
|---|---|---|
| 0 | stopped, or drained after SIGTERM | leave it stopped (it was asked to stop) |
| 2 | bad command line or topology | not expect a restart to help |
| 3 | the worker ranks failed during start-up (the error names rank, cause, log) | not expect a restart to help |
| 75 | the engine died while serving (a rank died, a step hung); ``EX_TEMPFAIL`` of sysexits.h | restart it |

A server killed by a signal reports ``-N`` (Python's ``Popen``) or ``128 + N`` (shells, ``srun``).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_STARTUP = 3
EXIT_ENGINE_DEAD = 75

_MEANINGS = {EXIT_OK: "stopped", EXIT_CONFIG: "bad configuration", EXIT_STARTUP: "start-up failed",
             EXIT_ENGINE_DEAD: "engine dead"}


def describe(code: int) -> str:
    """``exit code 75 (engine dead)``; a negative code is a signal: ``exit code -9 (killed by signal 9)``."""
    if code < 0:
        return f"exit code {code} (killed by signal {-code})"
    meaning = _MEANINGS.get(code)
    return f"exit code {code}" + (f" ({meaning})" if meaning else "")
