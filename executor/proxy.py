"""The proxy of frontend 0: private IPC directory, HMAC key, MPI launch of the worker ranks.

Launch: ``mpiexec -n tp_size python -m executor.worker_main --ipc-dir DIR`` in its own process
group. We launch through ``mpiexec`` (mpich's hydra, from the venv's ``bin/``) rather than
``MPIPoolExecutor``'s dynamic spawn so that the HTTP process never joins the MPI job: a rank that
dies then takes down its MPI job, never the frontend, and the frontend stays free to report it.
The exit of ``mpiexec`` is the second death path (besides the pidfd monitor).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import zmq

from executor.ipc import Codec, new_key
from executor.messages import Ack, RankFailed, RankHello, RankReady
from executor.monitor import RankProcess, proc_start_time
from executor.role_plugins import worker_plugin
from pdserve.config import ServerConfig

log = logging.getLogger(__name__)

ATTACH_ENV = "PDSERVE_ATTACH"  # attach info for frontends 1..K-1 (popped on read)


class StartupError(RuntimeError):
    """The worker ranks did not come up; the message names the rank, the cause and the log file."""


@dataclass
class AttachInfo:
    """What a frontend needs to join the lattice (JSON-able; the key travels hex-encoded)."""

    ipc_dir: str
    key_hex: str
    ingress_addr: str
    lane_addrs: list[str]
    ranks: list[dict]           # RankProcess fields of every rank
    worker_info: dict           # rank 0's READY info (max_model_len, vocab, layout, eos ids)
    frontend_id: int = 0
    server: dict = field(default_factory=dict)  # ServerConfig as JSON

    def to_env(self, frontend_id: int) -> str:
        return json.dumps({**asdict(self), "frontend_id": frontend_id})

    @classmethod
    def pop_from_env(cls) -> "AttachInfo":
        """Read and remove the attach info from the environment. Raises KeyError if absent."""
        return cls(**json.loads(os.environ.pop(ATTACH_ENV)))

    def rank_processes(self) -> list[RankProcess]:
        return [RankProcess(**r) for r in self.ranks]


def mpiexec_path() -> str:
    """``mpiexec`` next to this Python (the venv's bin/), else on PATH. Raises StartupError."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if not found:
        raise StartupError("mpiexec not found: install the mpich wheel (pip install mpich) into this environment")
    return found


def ipc_parent() -> str | None:
    """Where IPC directories go: ``/dev/shm`` (tmpfs) where writable, so that tensor-parallel KV
    cache files in them are shared memory rather than disk-backed files; else the temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


class Proxy:
    """Creates the IPC directory and key, launches the ranks, runs the READY handshake."""

    def __init__(self, cfg: ServerConfig, num_frontends: int, rank_log: Path) -> None:
        self.cfg, self.num_frontends, self.rank_log = cfg, num_frontends, rank_log
        self.ipc_dir = Path(tempfile.mkdtemp(prefix=f"pdserve-{cfg.role}{cfg.index}-", dir=ipc_parent()))  # mode 0700
        self.key = new_key()
        (self.ipc_dir / "key").write_bytes(self.key)
        os.chmod(self.ipc_dir / "key", 0o600)
        self.codec = Codec(self.key)
        self.ready_addr = f"ipc://{self.ipc_dir}/ready"
        self.ingress_addr = f"ipc://{self.ipc_dir}/ingress"
        self.lane_addrs = [f"ipc://{self.ipc_dir}/lane{i}" for i in range(num_frontends)]
        self.proc: subprocess.Popen | None = None
        self.exited = threading.Event()
        self._router: zmq.Socket | None = None  # the READY socket, from launch() to wait_ready()

    def start(self, timeout_s: float) -> AttachInfo:
        """Launch the ranks and wait for every READY (bounded by ``timeout_s``). Raises StartupError."""
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Write the ranks' spec, bind the READY socket and start ``mpiexec`` (returns at once; the
        ranks load while the caller goes on). :meth:`wait_ready` or :meth:`abort` must follow.
        Raises OSError when ``mpiexec`` cannot be started."""
        tp = self.cfg.engine.tp_size
        spec = {"server": self.cfg.model_dump(mode="json"), "role_plugin": worker_plugin(self.cfg.role),
                "frontend_pid": os.getpid(), "frontend_start_time": proc_start_time(os.getpid()),
                "ready_addr": self.ready_addr, "ingress_addr": self.ingress_addr, "lane_addrs": self.lane_addrs}
        (self.ipc_dir / "spec.json").write_text(json.dumps(spec))
        router = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(self.ready_addr)  # bound before the ranks start: their first HELLO is never lost
        # -launcher fork: the ranks always run on this host. Inside a Slurm step hydra would
        # otherwise launch them with a nested srun, which waits for CPUs the step already holds.
        argv = [mpiexec_path(), "-launcher", "fork", "-n", str(tp), sys.executable, "-m", "executor.worker_main",
                "--ipc-dir", str(self.ipc_dir)]
        # The ranks set their OpenMP wait policy themselves (engine.openmp_wait, executor.rank_threads):
        # passive unless their threads own their cores (a spinning rank slowed SmolLM2 8x in tests).
        env = {**os.environ,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        self.rank_log.parent.mkdir(parents=True, exist_ok=True)
        log.info("launching %d worker rank(s): %s (log: %s)", tp, " ".join(argv), self.rank_log)
        try:
            with open(self.rank_log, "ab") as out:
                self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, start_new_session=True)
        except OSError:
            router.close()
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            raise
        self._router = router

    def wait_ready(self, timeout_s: float) -> AttachInfo:
        """Wait for every rank's READY (bounded by ``timeout_s``), ack them; the attach info.
        Raises StartupError (the ranks are stopped and the IPC directory removed)."""
        router, self._router = self._router, None
        assert router is not None, "wait_ready() without launch()"
        try:
            ranks, info = self._handshake(router, self.cfg.engine.tp_size, timeout_s)
            for identity in ranks:
                router.send_multipart([identity, self.codec.encode(Ack())])
        except StartupError:
            self.stop()
            raise
        finally:
            router.close()
        threading.Thread(target=self._wait_exit, name="mpiexec-waiter", daemon=True).start()
        return AttachInfo(ipc_dir=str(self.ipc_dir), key_hex=self.key.hex(), ingress_addr=self.ingress_addr,
                          lane_addrs=self.lane_addrs, ranks=[asdict(r) for r in ranks.values()],
                          worker_info=info, server=self.cfg.model_dump(mode="json"))

    def abort(self) -> None:
        """The frontend failed between :meth:`launch` and :meth:`wait_ready`: SIGTERM the ranks'
        process group, wait for it (bounded) and remove the IPC directory."""
        if self._router is not None:
            self._router.close()
            self._router = None
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc, signal.SIGTERM)
        self.stop(timeout_s=5.0)

    def _handshake(self, router: zmq.Socket, tp: int, timeout_s: float) -> tuple[dict[bytes, RankProcess], dict]:
        deadline = time.monotonic() + timeout_s
        hello: dict[int, tuple[int, int]] = {}
        ready: dict[bytes, RankProcess] = {}
        info: dict = {}
        while len(ready) < tp:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(tp)) - {r.rank for r in ready.values()})
                raise StartupError(f"worker rank(s) {missing} not ready within {timeout_s:g} s (log: {self.rank_log})")
            exited = self.proc.poll() is not None
            if not router.poll(0 if exited else int(min(left, 0.2) * 1000)):
                if exited:  # every message the ranks sent before they exited has been read
                    raise StartupError(f"worker ranks exited during start-up (mpiexec exit code "
                                       f"{self.proc.returncode}); ranks that said hello: {sorted(hello)}; "
                                       f"log: {self.rank_log}\n{_tail(self.rank_log)}")
                continue
            identity, data = router.recv_multipart()
            msg = self.codec.try_decode(data)
            if msg is None:
                continue
            if isinstance(msg, RankHello):
                hello[msg.rank] = (msg.pid, msg.start_time)
            elif isinstance(msg, RankFailed):  # read even after the ranks exited: it names the cause
                raise StartupError(f"worker rank {msg.rank} failed during start-up: {msg.cause} (log: {self.rank_log})")
            elif isinstance(msg, RankReady):
                pid, start = hello[msg.rank]
                ready[identity] = RankProcess(rank=msg.rank, pid=pid, start_time=start)
                if msg.rank == 0:
                    info = msg.info
        return ready, info

    def _wait_exit(self) -> None:
        self.proc.wait()
        self.exited.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the ranks to exit (after a shutdown message), SIGTERM/SIGKILL their group, clean up."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("worker ranks did not exit within %.0f s; terminating them", timeout_s)
                _signal_group(self.proc, signal.SIGTERM)
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    _signal_group(self.proc, signal.SIGKILL)
                    self.proc.wait(5)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
