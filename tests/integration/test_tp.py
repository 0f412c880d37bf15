"""Tensor parallel servers (MPI ranks) with real processes, on a tiny Llama whose 3 KV heads split
unevenly over TP=2 (1 + 2, like SmolLM2): TP=2 == TP=1, and every ctx/gen TP pairing
(1→1, 2→2, 2→1, 1→2) decodes exactly like the colocated path, with the KV moving over UCX.

File "a" (ctx TP2, gen TP1) lets same-host servers read each other's caches; file "b" (ctx TP1,
gen TP2) sets ``same_host_reads: false``, so its servers take or send every byte as UCX messages.
Across the pairings both byte paths run: 2→1 reads directly, 1→1, 2→2 and 1→2 use messages."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.procs import Cluster, write_topology

NAME = "tiny-uneven"
PROMPTS = ["a", "The quick brown fox jumps over the lazy dog", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
           "Once upon a time in a land far, far away, there lived a very small model with three heads."]


@pytest.fixture(scope="module")
def uneven_model(tmp_path_factory):
    from engine.tiny import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-uneven"), seed=1, hidden_size=96, num_attention_heads=6,
                           num_key_value_heads=3, intermediate_size=99)


@pytest.fixture(scope="module")
def servers(uneven_model, procs, tmp_path_factory) -> dict[str, str]:
    """ctx TP2 + gen TP1 from one file, ctx TP1 + gen TP2 from another: four servers."""
    tmp = tmp_path_factory.mktemp("topo")
    urls, names = {}, []
    for tag, ctx_tp, gen_tp in (("a", 2, 1), ("b", 1, 2)):
        topo = write_topology(tmp / f"{tag}.yaml", str(uneven_model), NAME,
                              kv_transfer={"backend": "ucx", "same_host_reads": tag == "a"})
        doc = Cluster(topo, procs).doc
        doc["pools"]["ctx"]["engine"] = {"tp_size": ctx_tp}
        doc["pools"]["gen"]["engine"] = {"tp_size": gen_tp}
        import yaml

        topo.write_text(yaml.safe_dump(doc))
        cluster = Cluster(topo, procs)
        for role, tp in (("ctx", ctx_tp), ("gen", gen_tp)):
            name = f"{role}-tp{tp}-{tag}"
            procs.start(name, "-m", f"{role}_worker", "--config", str(topo), "--log-dir", str(procs.log_dir))
            urls[f"{role}{tp}"] = cluster.server_url(role)
            names.append((name, cluster.server_url(role)))
    for name, url in names:
        procs.wait_healthy(name, url, 240)
    return urls


def body(prompt: str, **kw) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **kw}


def complete(url: str, b: dict) -> str:
    r = httpx.post(url + "/v1/completions", json=b, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def disaggregated(ctx: str, gen: str, prompt, **kw) -> str:
    r = httpx.post(ctx + "/v1/completions", timeout=120,
                   json=body(prompt, disaggregated_params={"request_type": "context_only"}, **kw))
    assert r.status_code == 200, r.text
    params = {**r.json()["choices"][0]["disaggregated_params"], "request_type": "generation_only"}
    return complete(gen, body(prompt, disaggregated_params=params, **kw))


def test_layouts_split_heads_unevenly(servers):
    info = httpx.get(servers["gen2"] + "/server_info", timeout=10).json()
    assert info["kv_backend"] == "ucx"
    assert [(l["tp_rank"], l["tp_size"], l["num_kv_heads"]) for l in info["kv_layouts"]] == [(0, 2, 1), (1, 2, 2)]
    assert len(info["ranks"]) == 2


def test_tp2_equals_tp1_colocated(servers):
    for prompt in PROMPTS:
        assert complete(servers["gen2"], body(prompt)) == complete(servers["gen1"], body(prompt)), prompt


@pytest.mark.parametrize("ctx_tp,gen_tp", [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_disaggregated_tp_pairings_equal_colocated(servers, ctx_tp, gen_tp):
    for prompt in PROMPTS:
        reference = complete(servers["gen1"], body(prompt))
        assert disaggregated(servers[f"ctx{ctx_tp}"], servers[f"gen{gen_tp}"], prompt) == reference, prompt
    for role_tp in (f"ctx{ctx_tp}", f"gen{gen_tp}"):
        info = httpx.get(servers[role_tp] + "/server_info", timeout=10).json()
        assert info["free_blocks"] == info["total_blocks"], role_tp
    if gen_tp == 2:  # file "b": no same-host reads, every byte came as UCX messages
        assert httpx.get(servers["gen2"] + "/server_info", timeout=10).json()["kv_same_host_reads"] == 0
    if (ctx_tp, gen_tp) == (2, 1):  # both from file "a": each ctx shard was read straight from its process
        assert httpx.get(servers["gen1"] + "/server_info", timeout=10).json()["kv_same_host_reads"] >= 2 * len(PROMPTS)


def test_prefix_cache_ctx_tp2_to_gen_tp1(servers):
    """A prompt repeated on a TP-2 ctx server hits its cache (block hashes ignore the TP layout); the
    TP-1 gen server's answer equals the colocated one and reports the ctx hit."""
    prompt = list(range(3, 3 + 69))                          # block_size 4: 17 full blocks + 1 token
    reference = complete(servers["gen1"], body(prompt, cache_salt="tp-ref"))
    for want in (0, 68):
        r = httpx.post(servers["ctx2"] + "/v1/completions", timeout=120,
                       json=body(prompt, cache_salt="tp-shared", disaggregated_params={"request_type": "context_only"}))
        assert r.status_code == 200, r.text
        ctx_params = r.json()["choices"][0]["disaggregated_params"]
        assert ctx_params["cached_tokens"] == want
        g = httpx.post(servers["gen1"] + "/v1/completions", timeout=120,
                       json=body(prompt, cache_salt="tp-shared",
                                 disaggregated_params={**ctx_params, "request_type": "generation_only"}))
        assert g.status_code == 200, g.text
        assert g.json()["choices"][0]["text"] == reference
        assert g.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == want



def _server_counts(url: str) -> tuple[int, int]:
    info = httpx.get(url + "/server_info", timeout=10).json()
    return info["kv_blocks_pulled"], info["kv_blocks_skipped"]


@pytest.mark.parametrize("ctx_tp,gen_tp", [(2, 1), (1, 2)])
def test_turn_two_pulls_only_the_missing_blocks_across_tp_sizes(servers, ctx_tp, gen_tp):
    """Turn 2 extends turn 1's prompt: the gen server already holds turn 1's 7 full blocks (pulled in
    turn 1), so the TP-mismatched pull copies exactly the 6 it lacks; the answer equals a full pull
    (another salt: no block shared) and the colocated one."""
    ctx, gen = servers[f"ctx{ctx_tp}"], servers[f"gen{gen_tp}"]
    salt = f"turns-{ctx_tp}-{gen_tp}"
    turn1 = list(range(5, 5 + 30))                           # block_size 4: 7 full blocks + 2 tokens
    turn2 = turn1 + list(range(400, 420))                    # 50 tokens: 13 blocks, block 7 differs
    pulled0, skipped0 = _server_counts(gen)
    assert disaggregated(ctx, gen, turn1, cache_salt=salt) == complete(servers["gen1"], body(turn1, cache_salt="ref"))
    pulled1, skipped1 = _server_counts(gen)
    assert (pulled1 - pulled0, skipped1 - skipped0) == (8, 0)
    partial = disaggregated(ctx, gen, turn2, cache_salt=salt)
    pulled2, skipped2 = _server_counts(gen)
    assert (pulled2 - pulled1, skipped2 - skipped1) == (6, 7)
    full = disaggregated(ctx, gen, turn2, cache_salt=salt + "-full")
    assert _server_counts(gen) == (pulled2 + 13, skipped2)
    assert partial == full == complete(servers["gen1"], body(turn2, cache_salt="ref"))
    for url in (ctx, gen):
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["free_blocks"] == info["total_blocks"], url
