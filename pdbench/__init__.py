"""pdbench: the load generator behind ``pdserve bench`` (OpenAI HTTP, httpx, no torch).

Modules: :mod:`.metrics` (pure metric arithmetic), :mod:`.datasets` (synthetic workloads),
:mod:`.client` (one timed request), :mod:`.runner` (arrivals, concurrency), :mod:`.report`
(table, JSON, plots), :mod:`.cli` (the command line).
"""
