"""Start one ctx or gen server from a topology file: ``python -m ctx_worker --config FILE --index N``.

Two executors (``engine.executor`` in the topology):
- ``mpi`` (default): the lattice. This process is frontend 0: its proxy launches the worker ranks
  over MPI and waits for their READY, then it re-execs ``num_frontends - 1`` attached frontends;
  all frontends serve the same port (SO_REUSEPORT).
- ``inproc``: the engine loop runs in a thread of this process (tests, debugging).

Order matters: the port is bound first (a conflict fails fast, before any weights load) but only
listens once the engine is ready, so a server that accepts connections is ready to serve. Then the
lattice's ranks are launched **before** this process imports torch, the engine and the HTTP stack
(seconds: 2.8 s here on an idle machine, more under load), so the ranks' own imports and weight
load overlap the frontend's instead of following them: that serial stretch was part of every cold
start and every restart. Hence the function-local imports below.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

# Only light modules at the top (no torch, no FastAPI): see the module docstring.
from executor import registration
from executor.proxy import Proxy, StartupError
from pdserve.api_keys import MissingApiKey, load_api_key
from pdserve.config import Role, ServerConfig, TopologyError, load_topology
from pdserve.devices import visible_cuda_devices
from pdserve.dtypes import emulation_warning, read_cpu_flags
from pdserve.exit_codes import EXIT_CONFIG, EXIT_STARTUP

if TYPE_CHECKING:
    from executor.http_server import ServerState
    from executor.lifecycle import Advisor

log = logging.getLogger("pdserve.server")


def resolve_dtype_once(cfg: ServerConfig, cpu_flags: frozenset[str],
                       num_cuda_devices: int | None = None) -> ServerConfig:
    """``cfg`` with ``engine.device`` and then ``engine.dtype`` concrete, for a process that sees
    ``num_cuda_devices`` GPUs (None: ask torch, only when the device setting is not ``cpu``) on a CPU
    with ``cpu_flags``; warns when the dtype is bf16 on a CPU without native bf16 (emulated: 5-20x
    slower prefill).

    The one place a server resolves its device and dtype (``main``, before anything is launched):
    the ranks, the attached frontends, the engine and the KV layout (``/server_info``, the
    orchestrator's join check) all get the concrete values. Raises ValueError for a CUDA device
    this process cannot see.
    """
    if num_cuda_devices is None:
        num_cuda_devices = 0 if cfg.engine.device == "cpu" else visible_cuda_devices()
    cfg = cfg.with_resolved_device(num_cuda_devices)
    device = cfg.engine.device
    resolved = cfg.with_resolved_dtype(cpu_flags, device)
    if (warning := emulation_warning(resolved.engine.dtype, cpu_flags, device)) is not None:
        log.warning("%s[%d]: %s", cfg.role, cfg.index, warning)
    if cfg.engine.dtype == "auto":
        log.info("%s[%d]: engine.dtype auto resolved to %s on %s", cfg.role, cfg.index, resolved.engine.dtype, device)
    return resolved


def build_inproc_state(cfg: ServerConfig) -> ServerState:
    """Load the engine in this process and run its loop in a thread."""
    from executor.inproc_executor import InProcessExecutor
    from executor.kv_role import RankShards
    from executor.messages import EngineDead
    from executor.role_plugins import load_plugin, worker_plugin
    from executor.server_setup import kv_layout, make_engine, make_state
    from executor.step_guard import guard_engine

    if cfg.engine.tp_size > 1:
        raise ValueError(f"engine.executor 'inproc' runs one rank; tp_size={cfg.engine.tp_size} needs executor 'mpi'")
    if "auto" in (cfg.engine.dtype, cfg.engine.device):  # built without main() (tests, embedding): resolve here, once
        cfg = resolve_dtype_once(cfg, read_cpu_flags())
    t0 = time.perf_counter()
    engine = make_engine(cfg)
    log.info("%s[%d]: engine ready in %.1f s (context window %d tokens)", cfg.role, cfg.index,
             time.perf_counter() - t0, engine.max_model_len)
    layout = kv_layout(cfg, engine)
    executor = InProcessExecutor(engine, load_plugin(worker_plugin(cfg.role))(cfg, layout),
                                 RankShards([engine.kv_cache], [layout]))
    watchdog = guard_engine(engine, cfg.engine.step_timeout_s, lambda why: executor.dispatch(EngineDead(why)))
    state = make_state(cfg, executor, layout, engine.model_config.vocab_size)
    state.on_shutdown.append(executor.shutdown)
    state.on_shutdown.append(watchdog.stop)
    executor.start()
    return state


def launch_ranks(cfg: ServerConfig, log_dir: Path) -> Proxy:
    """Start the lattice's worker ranks now (returns at once; :func:`build_lattice_state` waits for
    their READY). Raises OSError when ``mpiexec`` cannot be started."""
    proxy = Proxy(cfg, cfg.engine.num_frontends, log_dir / f"{cfg.role}{cfg.index}.ranks.log")
    proxy.launch()
    return proxy


def build_lattice_state(cfg: ServerConfig, log_dir: Path, proxy: Proxy | None = None,
                        t0: float | None = None) -> ServerState:
    """Frontend 0: launch the ranks (proxy; ``proxy`` if :func:`launch_ranks` did it already, at
    ``time.perf_counter()`` ``t0``), attach a lattice client, start the attached frontends.
    Raises StartupError (the ranks are stopped)."""
    if proxy is None:
        if cfg.engine.dtype == "auto":  # built without main(): resolve before the ranks see it
            cfg = resolve_dtype_once(cfg, read_cpu_flags())
        t0 = time.perf_counter()
        proxy = launch_ranks(cfg, log_dir)
    t0 = time.perf_counter() if t0 is None else t0
    try:
        from executor.frontends import AttachedFrontends, lattice_state, load_tokenizer
    except BaseException:
        proxy.abort()  # the ranks are loading: end them, or they would wait for a READY ack forever
        raise
    # The tokenizer (seconds: transformers' import and files) loads while the ranks start, not after:
    # measured 6.5 s of a tiny-model cold start here that sat after the ranks' READY.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as pool:
        tokenizer = pool.submit(load_tokenizer, cfg)
        info = proxy.wait_ready(cfg.engine.worker_start_timeout_s)
        log.info("%s[%d]: %d worker rank(s) ready in %.1f s", cfg.role, cfg.index, cfg.engine.tp_size,
                 time.perf_counter() - t0)
        try:
            state, client = lattice_state(cfg, info, tokenizer.result(cfg.engine.worker_start_timeout_s))
        except Exception:
            proxy.stop()  # the ranks are up (or just died): end them and remove the IPC directory
            raise

    def watch_ranks() -> None:  # second death path: the MPI job itself ended
        proxy.exited.wait()
        time.sleep(0.2)  # let the pidfd monitor name the rank when a rank's death ended the job
        client.die_if_alive(f"worker ranks exited (mpiexec exit code {proxy.proc.returncode})")

    threading.Thread(target=watch_ranks, name="mpiexec-watch", daemon=True).start()
    attached = AttachedFrontends(info, cfg, log_dir)
    attached.start()
    attached.wait_ready(cfg.engine.worker_start_timeout_s)

    async def stop() -> None:
        attached.stop()
        if client.state.value != "dead":
            client.send_engine_shutdown()  # frontend 0 only: attached frontends never send it
        await client.shutdown()
        proxy.stop()

    state.on_shutdown.append(stop)
    return state


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound with SO_REUSEPORT (shared by every frontend of the server)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def serve(state: ServerState, sock: socket.socket, exit_when_dead: bool = True,
          advisor: Advisor | None = None) -> int:
    """Run uvicorn on an already bound socket until it stops; the exit status (see
    :mod:`executor.lifecycle`: 0 stopped or drained after SIGTERM, 75 the engine died).
    ``advisor``: whom a SIGTERM asks how to drain (frontend 0: the orchestrator; None: wait)."""
    import uvicorn

    from executor.http_server import create_server_app
    from executor.lifecycle import ExitPolicy, LifecycleServer, ServerLifecycle

    config = uvicorn.Config(create_server_app(state), log_level="warning", timeout_graceful_shutdown=5)
    lifecycle = ServerLifecycle(state.client, ExitPolicy.of(state.config.engine, exit_when_dead), advisor=advisor)
    LifecycleServer(config, lifecycle).run(sockets=[sock])
    return lifecycle.exit_code


def parse_args(role: Role, argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -m {role}_worker", description=f"Run one pdserve {role} server.")
    p.add_argument("--config", required=True, help="topology YAML file")
    p.add_argument("--index", type=int, default=0, help=f"which server of pools.{role}.servers (default 0)")
    p.add_argument("--log-dir", default="logs", help="where the worker ranks' log goes (default: logs)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--host", default=None, help="bind host (default: the topology's)")  # control plane:
    p.add_argument("--port", type=int, default=None, help="HTTP port (default: the topology's; 0 = any free)")
    return p.parse_args(argv)


def main(role: Role, argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ctx_worker`` / ``python -m gen_worker``. Returns the exit code."""
    args = parse_args(role, argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"%(asctime)s {role}[{args.index}] %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_topology(args.config).server_config(role, args.index, host=args.host, port=args.port)
        load_api_key(cfg.api_key_env)  # unset or empty: refuse at once, before any rank starts
    except (TopologyError, IndexError, MissingApiKey) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        cfg = resolve_dtype_once(cfg, read_cpu_flags())
    except ValueError as err:  # a CUDA device this process does not see
        print(f"error: {err}", file=sys.stderr)
        return EXIT_CONFIG
    sock = bind_socket(cfg.host, cfg.port)
    cfg = registration.with_bound_port(cfg, sock)  # control plane: --port 0
    log.info("%s[%d]: loading %s (%s executor, %s on %s, %s KV blocks of %d tokens)", role, cfg.index, cfg.model.path,
             cfg.engine.executor, cfg.engine.dtype, cfg.engine.device,
             cfg.engine.num_kv_blocks or "auto-sized", cfg.engine.block_size)
    if cfg.engine.executor == "inproc":
        state = build_inproc_state(cfg)
    else:
        t0 = time.perf_counter()
        try:
            proxy = launch_ranks(cfg, Path(args.log_dir))  # first: see the module docstring
        except OSError as err:
            log.error("start-up failed: cannot start the worker ranks: %s", err)
            print(f"error: cannot start the worker ranks: {err}", file=sys.stderr)
            return EXIT_STARTUP
        try:
            state = build_lattice_state(cfg, Path(args.log_dir), proxy, t0)
        except StartupError as err:
            log.error("start-up failed: %s", err)
            print(f"error: {err}", file=sys.stderr)
            return EXIT_STARTUP
    registrar = registration.attach(state)  # control plane: register + heartbeat (frontend 0 only)
    log.info("%s[%d]: serving on http://%s:%d", role, cfg.index, cfg.host, cfg.port)
    code = serve(state, sock, advisor=registration.drain_advisor(registrar).ask)
    log.info("%s[%d]: exiting with status %d", role, cfg.index, code)
    exit_now(code)
    return code  # not reached


def exit_now(code: int) -> None:
    """Leave the process without the interpreter's final garbage collection.

    Everything the server owns was stopped by the app's lifespan (ranks, IPC directory,
    attached frontends, registration) before this runs; what is left is the final collection of
    the torch/transformers heap, which took 4 s here (a faulthandler dump showed only
    "Garbage-collecting"): 4 s between a dead engine and its launcher seeing the exit.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
