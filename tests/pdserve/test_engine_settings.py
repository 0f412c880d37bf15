"""One engine configuration model: a pool's ``engine:`` overrides are a partial EngineSettings."""

from __future__ import annotations

import pytest
import yaml

from pdserve.config import EngineSettings, Topology, TopologyError, parse_topology

SERVERS = {"ctx": [{"port": 8001}], "gen": [{"port": 8002}]}


def _doc(top: dict | None = None, ctx: dict | None = None, gen: dict | None = None) -> dict:
    pools = {role: {"servers": SERVERS[role], **({"engine": eng} if eng is not None else {})}
             for role, eng in (("ctx", ctx), ("gen", gen))}
    return {"engine": top or {}, "pools": pools}


@pytest.mark.parametrize("gen,message", [
    ({"blok_size": 4}, "pools.gen.engine.blok_size: unknown key"),
    ({"max_batch_size": "many"}, "pools.gen.engine.max_batch_size: Input should be a valid integer"),
    ({"num_threads": 0}, "pools.gen.engine.num_threads: Input should be greater than or equal to 1"),
    ({"executor": "threads"}, "pools.gen.engine.executor: Input should be 'mpi' or 'inproc'"),
    ({"device": "tpu"}, "pools.gen.engine.device: String should match pattern"),
])
def test_a_bad_override_names_the_pool_and_the_key(gen, message):
    with pytest.raises(TopologyError) as err:
        parse_topology(_doc(gen=gen))
    assert message in str(err.value)


def test_only_the_keys_a_pool_sets_override_even_a_default_value():
    t = parse_topology(_doc(top={"max_batch_size": 8, "num_threads": 2}, gen={"max_batch_size": 16}))
    assert t.pool_engine("ctx").max_batch_size == 8
    assert t.pool_engine("gen").max_batch_size == 16  # 16 is the default, set here: it overrides
    assert t.pool_engine("gen").num_threads == 2      # not set here: inherited
    assert t.pools.gen.engine.model_fields_set == {"max_batch_size"}


def test_a_null_override_inherits():
    t = parse_topology(_doc(top={"num_kv_blocks": 512, "dtype": "float32"}, gen={"num_kv_blocks": None, "dtype": None}))
    assert t.pool_engine("gen").num_kv_blocks == 512 and t.pool_engine("gen").dtype == "float32"


def test_merged_replaces_the_set_keys_and_keeps_the_rest():
    base = EngineSettings(block_size=32, num_threads=2)
    merged = base.merged(EngineSettings.model_validate({"num_threads": 1, "tp_size": 2}))
    assert (merged.block_size, merged.num_threads, merged.tp_size) == (32, 1, 2)
    assert base.merged(EngineSettings()) == base


def test_a_dumped_topology_reparses_to_the_same_servers():
    """config check prints it; the orchestrator's worker processes receive it as JSON."""
    t = parse_topology(_doc(top={"num_threads": 2, "dtype": "float32", "max_batch_size": 8},
                            ctx={"tp_size": 2}, gen={"enable_prefix_caching": False, "max_batch_size": 16}))
    dumped = t.model_dump(mode="json")
    assert dumped["pools"]["ctx"]["engine"] == {"tp_size": 2}
    assert dumped["pools"]["gen"]["engine"] == {"enable_prefix_caching": False, "max_batch_size": 16}
    again = parse_topology(yaml.safe_load(yaml.safe_dump(dumped)))
    for role in ("ctx", "gen"):
        assert again.server_config(role, 0) == t.server_config(role, 0)
    assert Topology.model_validate(dumped).pool_engine("gen") == t.pool_engine("gen")


def test_a_server_config_carries_the_merged_settings_whole():
    t = parse_topology(_doc(top={"num_threads": 2}, gen={"tp_size": 2}))
    cfg = t.server_config("gen", 0)
    assert cfg.engine == t.pool_engine("gen")
    assert type(cfg).model_validate(cfg.model_dump(mode="json")) == cfg  # what the MPI ranks rebuild
