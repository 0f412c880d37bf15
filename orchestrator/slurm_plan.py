"""``python -m orchestrator.slurm_plan TOPOLOGY NODE...``: where each process of a cluster runs.

Used by ``slurm/pdserve.sbatch`` inside its allocation. Prints shell assignments (``eval`` them):
the orchestrator runs on the first node; ctx servers on the next ``launcher.slurm.ctx_nodes``
nodes, gen servers on the next ``gen_nodes`` (0, or too few nodes: share every node), each pool's
servers spread round robin over its nodes, and how often each pool's servers may be restarted
(``pools.<role>.max_restarts``, for ``slurm/restart_step.sh``).
"""

from __future__ import annotations

import shlex
import sys

from pdserve.config import Topology, TopologyError, load_topology


def plan(topology: Topology, nodes: list[str]) -> dict[str, object]:
    s = topology.launcher.slurm
    rest = nodes[1:]
    ctx_nodes = rest[:s.ctx_nodes] if s.ctx_nodes and len(rest) >= s.ctx_nodes + s.gen_nodes else nodes
    gen_nodes = rest[s.ctx_nodes:s.ctx_nodes + s.gen_nodes] if s.gen_nodes and len(rest) >= s.ctx_nodes + s.gen_nodes else nodes
    out: dict[str, object] = {"ORCH_NODE": nodes[0], "ORCH_PORT": topology.orchestrator.port}
    for role, pool_nodes in (("ctx", ctx_nodes), ("gen", gen_nodes)):
        n = topology.pool(role).initial_instances
        out[f"{role.upper()}_N"] = n
        out[f"{role.upper()}_NODES"] = [pool_nodes[i % len(pool_nodes)] for i in range(n)]
        out[f"{role.upper()}_TP"] = topology.pool_engine(role).tp_size
        out[f"{role.upper()}_MAX_RESTARTS"] = topology.pool(role).max_restarts
    out["CPUS_PER_SERVER"] = s.cpus_per_server
    return out


def shell(assignments: dict[str, object]) -> str:
    lines = []
    for key, value in assignments.items():
        if isinstance(value, list):
            lines.append(f"{key}=({' '.join(shlex.quote(str(v)) for v in value)})")
        else:
            lines.append(f"{key}={shlex.quote(str(value))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m orchestrator.slurm_plan TOPOLOGY NODE [NODE...]", file=sys.stderr)
        return 2
    try:
        topology = load_topology(args[0])
    except TopologyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if topology.launcher.kind != "slurm":
        print(f"error: {args[0]}: launcher.kind must be slurm for slurm/pdserve.sbatch", file=sys.stderr)
        return 2
    print(shell(plan(topology, args[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
