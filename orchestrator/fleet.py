"""Per-pool scaling: the orchestrator process owns the servers it launches.

Who starts processes: with ``launcher.kind: local`` or ``slurm`` the orchestrator holds a
:class:`Fleet` with a launcher backend (:class:`~orchestrator.backends.LocalBackend`: child
processes; :class:`~orchestrator.backends.SlurmBackend`: Slurm jobs). ``POST
/cluster/pools/{pool}/scale`` sets a pool's target size; a reconcile loop (one task, owned by the
app lifespan) launches instances until the pool reaches it, retires extra ones, and restarts a
launched server whose process died, up to ``max_restarts`` times. With ``kind: external`` there is
no fleet and scaling is refused (409): someone else runs the servers.

Retiring a server: mark it draining (the router picks it no more), wait until the orchestrator has
no request open on it and (ctx) no parked KV lease is left for a gen server to pull, ask the
server itself to drain, then stop it by PID / job id and drop it from the pool. Every wait is
bounded (``drain_timeout_s``, ``launcher.grace_s``).

A gen server retired with ``orchestrator.drain_mode: move_kv`` (the default) while another gen
server is ready is asked to drain *first*, with ``{"mode": "move_kv"}``: it moves each running
stream off at its next decode step (KV parked under a lease, the stream ended with a ``moved``
event that the relay continues on another gen server, which pulls the KV), so its requests and
moved leases are gone within seconds instead of a long decode. With no other ready gen server (or
``migration_limit: 0``, which leaves streams unmovable) the drain falls back to waiting, logged as
such: the mode a retirement took is :attr:`Instance.drain_mode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from pdserve.auth import auth_headers
from pdserve.config import Role, Topology

from .drain_notice import move_kv_refusal
from .exit_watch import ExitWatch
from .pools import ROLES, ClusterPools, Server
from .tasks import LoopTask, TaskOwner

log = logging.getLogger("orchestrator.fleet")

DRAIN_POLL_S = 0.1


@dataclass
class Instance:
    """One server the fleet launched (or adopted, for registered Slurm steps it can cancel)."""

    role: Role
    slot: int
    instance_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    url: str | None = None          # known at launch (local) or at registration (slurm)
    handle: object = None           # backend-specific: a Popen, a Slurm job id
    restarts: int = 0
    stopping: bool = False
    started_s: float = field(default_factory=time.monotonic)
    drain_mode: str | None = None   # how its retirement drained it: "move_kv" or "wait" (None: not retired)

    @property
    def name(self) -> str:
        return f"{self.role}#{self.slot}"


class Backend(Protocol):
    """Starts and stops servers. Every method is bounded in time."""

    kind: str

    async def launch(self, inst: Instance) -> None:
        """Start ``inst`` (sets ``inst.handle`` and, when known now, ``inst.url``). Raises OSError/RuntimeError."""

    async def exited(self, inst: Instance) -> str | None:
        """``None`` while ``inst`` runs, else why it is gone (e.g. ``exit code -9``)."""

    async def stop(self, inst: Instance, grace_s: float) -> None:
        """Stop ``inst`` (SIGTERM/scancel, then SIGKILL after ``grace_s``) and reap it."""

    def adopt(self, member: Server) -> Instance | None:
        """An :class:`Instance` that can stop a registered ``member`` (None: this backend cannot)."""


class ScaleError(ValueError):
    """A scale request outside the pool's bounds."""


class Fleet:
    """Target sizes and launched instances of both pools (see the module docstring)."""

    def __init__(self, topology: Topology, pools: ClusterPools, backend: Backend, client: httpx.AsyncClient,
                 tasks: TaskOwner) -> None:
        self.topology = topology
        self.pools = pools
        self.backend = backend
        self._client = client
        self._tasks = tasks
        self.targets: dict[str, int] = {r: topology.pool(r).initial_instances for r in ROLES}
        self.instances: list[Instance] = []
        self.retired = 0
        self._next_slot = {r: 0 for r in ROLES}
        self._wake = asyncio.Event()
        self._loop = LoopTask("orchestrator-fleet")
        self._settings = topology.launcher
        self._expected = {r: 0 for r in ROLES}  # started by someone else (slurm/pdserve.sbatch), not joined yet
        self._expect_until_s = 0.0
        self._exits = ExitWatch()  # a launched process's exit wakes the reconcile loop at once

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start(self._run())

    async def stop(self) -> None:
        """Stop the reconcile loop, then every launched server (concurrently, bounded)."""
        await self._loop.stop()
        self._exits.close()
        live = [i for i in self.instances if i.handle is not None]
        for inst in live:
            inst.stopping = True
        await asyncio.gather(*(self._stop_quietly(i) for i in live))
        self.instances.clear()

    # ---- scaling --------------------------------------------------------------------------
    def scale(self, role: Role, n: int) -> dict:
        """Set pool ``role``'s target size. Raises :class:`ScaleError` outside its bounds."""
        p = self.topology.pool(role)
        if not p.min_instances <= n <= p.max_instances:
            raise ScaleError(f"pools.{role}: {n} instances is outside [min_instances {p.min_instances}, "
                             f"max_instances {p.max_instances}]")
        log.info("scale %s: %d -> %d", role, self.size(role), n)
        self.targets[role] = n
        self._wake.set()
        return self.pool_status(role)

    def expect_started(self, within_s: float) -> None:
        """The first instances are started by someone else (the sbatch script's srun steps): count
        them as coming for ``within_s`` seconds instead of launching them again."""
        self._expected = dict(self.targets)
        self._expect_until_s = time.monotonic() + within_s

    def note_registered(self, role: Role) -> None:
        if self._expected[role] > 0:
            self._expected[role] -= 1

    def size(self, role: Role) -> int:
        """Members that are not draining, plus instances that have not joined yet."""
        pool = self.pools.pool(role)
        members = [s for s in pool.servers if not s.draining]
        pending = [i for i in self.instances if i.role == role and not i.stopping
                   and (i.url is None or pool.get(i.url) is None)]
        expected = self._expected[role] if time.monotonic() < self._expect_until_s else 0
        return len(members) + len(pending) + expected

    def pool_status(self, role: Role) -> dict:
        pool = self.pools.pool(role)
        return {"pool": role, "target": self.targets[role], "size": self.size(role), "ready": len(pool.ready()),
                "draining": sum(s.draining for s in pool.servers),
                "launching": sum(1 for i in self.instances if i.role == role and not i.stopping
                                 and (i.url is None or pool.get(i.url) is None)),
                "restarts": sum(i.restarts for i in self.instances if i.role == role)}

    def knows(self, instance_id: str | None) -> Instance | None:
        return next((i for i in self.instances if instance_id and i.instance_id == instance_id), None)

    def joined(self, inst: Instance, member: Server) -> None:
        """A launched instance registered (slurm: its URL is known only now)."""
        inst.url = member.url

    # ---- reconcile loop -------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            self._wake.clear()  # before: an exit seen during the reconcile wakes the next one at once
            try:
                await self.reconcile()
            except Exception:  # noqa: BLE001 - the loop must survive a failed launch or poll
                log.exception("fleet reconcile failed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._settings.monitor_interval_s):
                    await self._wake.wait()

    async def reconcile(self) -> None:
        for inst in [i for i in self.instances if not i.stopping and i.handle is not None]:
            why = await self.backend.exited(inst)
            if why is not None:
                await self._on_exit(inst, why)
        for role in ROLES:
            n = self.size(role)
            for _ in range(self.targets[role] - n):
                await self._launch(Instance(role, self._take_slot(role)))
            if n > self.targets[role]:
                for member, inst in self._victims(role, n - self.targets[role]):
                    self._retire(member, inst)

    def _take_slot(self, role: Role) -> int:
        used = {i.slot for i in self.instances if i.role == role}
        slot = 0
        while slot in used:
            slot += 1
        return slot

    async def _launch(self, inst: Instance) -> None:
        self.instances.append(inst)
        try:
            await self.backend.launch(inst)
        except (OSError, RuntimeError) as err:
            self.instances.remove(inst)
            log.error("launching %s failed: %s", inst.name, err)
            return
        log.info("launched %s (%s)", inst.name, inst.url or f"{self.backend.kind} {inst.handle}")
        self._watch_exit(inst)
        if inst.url is not None and self.pools.pool(inst.role).get(inst.url) is None:
            self.pools.pool(inst.role).add(inst.url, "managed", inst.instance_id)

    async def _on_exit(self, inst: Instance, why: str) -> None:
        pool = self.pools.pool(inst.role)
        member = pool.get(inst.url) if inst.url else None
        max_restarts = self.topology.pool(inst.role).max_restarts
        if inst.restarts < max_restarts:
            inst.restarts += 1
            log.warning("%s %s died (%s); restart %d of %d", inst.name, inst.url or "", why, inst.restarts,
                        max_restarts)
            if member is not None:
                member.mark_unhealthy(f"process died ({why}); restarting")
            inst.started_s = time.monotonic()
            try:
                await self.backend.launch(inst)
            except (OSError, RuntimeError) as err:
                log.error("restarting %s failed: %s", inst.name, err)
                return
            self._watch_exit(inst)
            return
        log.error("%s %s died (%s) after %d restarts; giving up on it", inst.name, inst.url or "", why, inst.restarts)
        self.instances.remove(inst)
        if member is not None:
            pool.remove(member, f"died after {inst.restarts} restarts")
        # A fresh instance would get a fresh restart budget: do not loop forever on a broken setup.
        self.targets[inst.role] = max(self.topology.pool(inst.role).min_instances, self.targets[inst.role] - 1)

    def _watch_exit(self, inst: Instance) -> None:
        """Wake the reconcile loop when ``inst``'s process exits (local processes; the poll of
        ``monitor_interval_s`` remains for everything else)."""
        pid_of = getattr(self.backend, "pid", None)
        pid = pid_of(inst) if pid_of is not None else None
        if pid is not None:
            self._exits.watch(pid, self._wake.set)

    def _victims(self, role: Role, n: int) -> list[tuple[Server | None, Instance]]:
        """Newest launched instances first (those still loading first of all), then stoppable
        registered members. Static members are never retired."""
        pool = self.pools.pool(role)
        out: list[tuple[Server | None, Instance]] = []
        launched = sorted((i for i in self.instances if i.role == role and not i.stopping),
                          key=lambda i: (i.url is not None and pool.get(i.url) is not None, -i.started_s))
        for inst in launched:
            if len(out) == n:
                return out
            member = pool.get(inst.url) if inst.url else None
            if member is not None and member.draining:
                continue
            out.append((member, inst))
        for member in sorted(pool.servers, key=lambda s: -s.joined_s):
            if len(out) == n:
                break
            if member.source == "registered" and not member.draining:
                inst = self.backend.adopt(member)
                if inst is not None:
                    out.append((member, inst))
        return out

    def _retire(self, member: Server | None, inst: Instance) -> None:
        inst.stopping = True
        if member is not None:
            member.start_draining()
        self._tasks.spawn(self._drain_and_stop(member, inst), name=f"retire-{inst.name}")

    async def _drain_and_stop(self, member: Server | None, inst: Instance) -> None:
        timeout_s = self.topology.orchestrator.drain_timeout_s
        if member is not None:
            inst.drain_mode = self.drain_mode_for(member)
            t0 = time.monotonic()
            if inst.drain_mode == "move_kv":
                await self._post_drain(member, "move_kv")  # first: its streams move instead of finishing there
            drained = await self._wait_idle(member, timeout_s, moved_leases=inst.drain_mode == "move_kv")
            if not drained:
                log.warning("%s still busy after %g s of draining; stopping it anyway", member.name, timeout_s)
            else:
                log.info("%s drained (%s) in %.2f s", member.name, inst.drain_mode, time.monotonic() - t0)
            if inst.drain_mode == "wait":
                await self._post_drain(member)
        await self._stop_quietly(inst)
        if inst in self.instances:
            self.instances.remove(inst)
        if member is not None:
            self.pools.pool(member.role).remove(member, "retired by scale-down")
        self.retired += 1
        self._wake.set()

    def drain_mode_for(self, member: Server) -> str:
        """``"move_kv"`` when ``member`` is a gen server, the topology asks for it, streams are
        movable (``migration_limit`` > 0) and another gen server is ready to take them; else
        ``"wait"`` (the fallback is logged with its reason)."""
        settings = self.topology.orchestrator
        if member.role != "gen" or settings.drain_mode != "move_kv":
            return "wait"
        why = move_kv_refusal(settings, self.pools, member)
        if why is None:
            return "move_kv"
        log.warning("%s %s: drain_mode move_kv falls back to wait: %s (in-flight requests finish there, "
                    "at most drain_timeout_s %g s)", member.name, member.url, why, settings.drain_timeout_s)
        return "wait"

    async def _wait_idle(self, member: Server, timeout_s: float, moved_leases: bool = False) -> bool:
        """Wait until no request is open on ``member`` and it holds no parked KV lease (``moved_leases``:
        a gen server's leases of moved requests count too)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if member.in_flight == 0 and await self._parked_leases(member, moved_leases) == 0:
                return True
            await asyncio.sleep(DRAIN_POLL_S)
        return False

    async def _parked_leases(self, member: Server, moved_leases: bool = False) -> int:
        if member.role != "ctx" and not moved_leases:
            return 0
        try:
            resp = await self._client.get(f"{member.url}/server_info", timeout=2.0)
            info = resp.json() if resp.status_code == 200 else {}
            return int(info.get("parked_leases", 0)) + int(info.get("moved_leases", 0))
        except (httpx.HTTPError, ValueError, AttributeError, TypeError):
            return 0  # unreachable: nothing left to wait for

    async def _post_drain(self, member: Server, mode: str = "wait") -> bool:
        """Ask ``member`` to drain (``POST /admin/drain {"mode": mode}``, whichever of its frontends
        answers). True when it confirmed (200 with state ``draining`` or ``dead``); otherwise the
        answer is logged and the server is stopped anyway (its stop is a SIGTERM, which drains it too)."""
        headers = auth_headers(self.topology.orchestrator.admin_token_env)
        try:
            resp = await self._client.post(f"{member.url}/admin/drain", headers=headers, timeout=2.0,
                                           json={"mode": mode})
        except httpx.HTTPError as err:
            log.warning("%s %s: POST /admin/drain failed: %s: %s", member.name, member.url, type(err).__name__, err)
            return False
        state = None
        with contextlib.suppress(ValueError, AttributeError):
            state = resp.json().get("state")
        if resp.status_code != 200 or state not in ("draining", "dead"):
            log.warning("%s %s did not confirm the drain: HTTP %d %s", member.name, member.url, resp.status_code,
                        resp.text[:200])
            return False
        return True

    async def _stop_quietly(self, inst: Instance) -> None:
        try:
            await self.backend.stop(inst, self._settings.grace_s)
            log.info("stopped %s %s", inst.name, inst.url or "")
        except Exception:  # noqa: BLE001 - stopping the rest matters more
            log.exception("stopping %s failed", inst.name)
