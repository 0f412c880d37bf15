"""engine.enable_prefix_caching and the served model name flow from the topology to the engine."""
from pdserve.config import parse_topology
from tests.executor.engine_args import engine_args


def test_enable_prefix_caching_per_pool():
    topo = parse_topology({"model": {"path": "/m", "name": "served-name"},
                           "pools": {"ctx": {"servers": [{"port": 9001}]},
                                     "gen": {"servers": [{"port": 9002}],
                                             "engine": {"enable_prefix_caching": False}}}})
    avx2 = frozenset({"avx2"})  # engine.device/dtype auto: resolved by the server before the engine is built
    resolved = (topo.server_config(role, 0).with_resolved_device(0).with_resolved_dtype(avx2) for role in ("ctx", "gen"))
    ctx, gen = (engine_args(cfg) for cfg in resolved)
    assert ctx["config"].enable_prefix_caching is True and gen["config"].enable_prefix_caching is False
    assert ctx["served_model_name"] == gen["served_model_name"] == "served-name"   # names blocks, as the KV layout does
    assert ctx["model"] == gen["model"] == "/m"
