"""How every orchestrator process serves: uvicorn's settings and the heap left to the cyclic GC.

* :data:`SERVE_OPTIONS` (``uvicorn.run`` / ``uvicorn.Config`` keywords): uvloop (``"auto"`` picks
  it: ``uvicorn[standard]``) and httptools with each response head sent in one write with the
  first body bytes (:class:`orchestrator.http_protocol.HeadWithBodyProtocol`), no access-log
  line per request (the request metrics count them), and no proxy-headers middleware, which rewrote each request's client
  address from ``X-Forwarded-For`` for nobody (nothing here reads it): ~30 µs per request in a
  py-spy profile at concurrency 1 on a loaded machine (``bench/dispatch_trace.py``'s client).
* :func:`freeze_startup_heap`: the ~64k objects that importing the app and building it leave
  (modules, pydantic schemas, routes) never become garbage, yet every full collection walked
  them: one every ~3,000 requests at concurrency 1, 130–830 ms of wall time each on the 2-core
  machine at load ~10, 10–90 ms once they are frozen (``gc.freeze``, as the stdlib's docs advise
  for long-lived processes).
"""

from __future__ import annotations

import gc

from .http_protocol import HeadWithBodyProtocol

SERVE_OPTIONS = {"timeout_graceful_shutdown": 5, "access_log": False, "loop": "auto", "http": HeadWithBodyProtocol,
                 "proxy_headers": False}


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now to the GC's permanent generation (call it
    right before serving: what a request allocates stays collectable)."""
    gc.collect()
    gc.freeze()
