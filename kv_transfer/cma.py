"""Same-host KV reads with ``process_vm_readv`` (cross-memory attach), failing cleanly.

Why not UCX's own ``cma`` transport: it is only selected on endpoints *without* error handling,
and on those a failed ``process_vm_readv`` (the peer died mid-copy) is fatal to the reading
process — UCX logs at FATAL level and aborts (``uct_cma_ep_tx_error``, UCX 1.21), so one ctx
crash would take every gen server that was pulling from it down. With error handling on, UCX
refuses shared-memory transports between such endpoints (only tcp remains: ~1.3 GB/s here). So the
UCX backend keeps UCX for control messages and cross-host data, and same-host bytes are read here:
the same syscall, with ``errno`` turned into :class:`CMAError`.

Protocol facts this relies on (process_vm_readv(2)): the reader needs ptrace read access to the
target (same uid; under Yama ``ptrace_scope`` 1 the target must allow it, see
:func:`allow_readers`); a vanished target gives ``ESRCH``, an unmapped range ``EFAULT``; a call may
transfer less than asked (partial reads are continued). ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from functools import lru_cache

_PR_SET_PTRACER = 0x59616D61  # prctl(2): "Yama"
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)
CHUNK_BYTES = 64 << 20  # one syscall at most: the deadline is checked between chunks


class CMAError(OSError):
    """A same-host read failed; ``errno`` says why (``EPERM``: not allowed, ``ESRCH``: peer gone)."""


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


@lru_cache(maxsize=1)
def host_identity() -> str:
    """Who can read whom: processes with equal identities share a kernel (boot id) and a PID
    namespace, so a pid sent by one means the same process to the other."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # unknown: never treated as the same host
    return f"{boot}:{pidns}"


def allow_readers() -> None:
    """Let other processes of this user read this one (Yama ``ptrace_scope`` 1 only allows
    ancestors otherwise). A no-op without Yama; never raises."""
    _libc().prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def read_remote(pid: int, remote_addr: int, local_addr: int, nbytes: int, deadline: float) -> None:
    """Copy ``nbytes`` from ``remote_addr`` in process ``pid`` to ``local_addr`` here.

    Copies in chunks of at most :data:`CHUNK_BYTES`; every chunk must *finish* by ``deadline``
    (``time.monotonic``), so a copy that completes counts only if all of it happened before the
    deadline — the peer guarantees its memory until then (and a while longer), not after.

    Raises:
        CMAError: the kernel refused or failed a read (errno set), or it returned no bytes.
        TimeoutError: ``deadline`` passed before the copy finished; the bytes read are not valid.
    """
    libc = _libc()
    done = 0
    while done < nbytes:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"same-host KV read stopped at {done} of {nbytes} bytes: deadline passed")
        size = min(CHUNK_BYTES, nbytes - done)
        local = _IOVec(local_addr + done, size)
        remote = _IOVec(remote_addr + done, size)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got < 0:
            err = ctypes.get_errno()
            raise CMAError(err, f"process_vm_readv from pid {pid}: {os.strerror(err)}")
        if got == 0:
            raise CMAError(errno.EIO, f"process_vm_readv from pid {pid} read nothing at byte {done} of {nbytes}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"same-host KV read finished past its deadline at byte {done + got} of {nbytes}")
        done += got
