"""The sampler contract: keyed randomness, batch invariance, exact filtering, the distribution."""
import math

import pytest
import torch

from engine.counter_rng import as_int64, gumbel, gumbel_argmax, mix64, stream_keys, uniforms
from engine.sampler import Sampler, _filter_candidates, _rows
from engine.sampling_params import SamplingParams

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def ref_splitmix64_next(state: int) -> tuple[int, int]:
    """Vigna's splitmix64.c next(), in plain Python ints: (new state, output)."""
    state = (state + GAMMA) & M64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return state, z ^ (z >> 31)


def ref_uniform(seed: int, choice: int, position: int, token: int) -> float:
    """The documented formula of engine.counter_rng, evaluated without torch."""
    key = ref_splitmix64_next(seed & M64)[1]
    key = ref_splitmix64_next(key ^ choice)[1]
    key = ref_splitmix64_next(key ^ position)[1]
    bits = ref_splitmix64_next((key + token * GAMMA) & M64)[1]
    return ((bits >> 40) + 0.5) / (1 << 24)


def test_splitmix64_known_answer_and_torch_matches_python():
    # splitmix64 seeded with 0: first output 0xE220A8397B1DCDAF (Vigna's reference generator).
    assert ref_splitmix64_next(0)[1] == 0xE220A8397B1DCDAF
    xs = [0, 1, 2**63 - 1, 2**63, M64, 0x0123456789ABCDEF, 42 * GAMMA & M64]
    got = mix64(torch.tensor([as_int64((x + GAMMA) & M64) for x in xs])).tolist()
    assert [g & M64 for g in got] == [ref_splitmix64_next(x)[1] for x in xs]


def test_uniforms_follow_the_documented_formula():
    cases = [(7, 0, 0), (7, 0, 1), (7, 1, 0), (-3, 2, 99), (2**70 + 5, 0, 12345)]
    keys = stream_keys(torch.tensor([as_int64(s) for s, _, _ in cases]),
                       torch.tensor([c for _, c, _ in cases]), torch.tensor([p for _, _, p in cases]))
    tokens = torch.tensor([0, 1, 17, 49151])
    u = uniforms(keys, tokens)
    for row, (s, c, p) in enumerate(cases):
        for col, t in enumerate(tokens.tolist()):
            assert u[row, col].item() == pytest.approx(ref_uniform(s, c, p, t), abs=0, rel=1e-7)
    assert 0 < u.min() and u.max() < 1


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": 5, **kw})


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


PROBS = [0.5, 0.2, 0.15, 0.1, 0.05]


@pytest.mark.parametrize("kw, kept", [
    (dict(top_k=2), {0, 1}),
    (dict(top_p=0.75), {0, 1, 2}),           # mass before token 2 is 0.70 < 0.75; before 3: 0.85
    (dict(top_p=0.5), {0}),                  # the first token alone reaches 0.5
    (dict(top_k=3, top_p=0.6), {0, 1}),      # top-k first: 0.588, 0.235, 0.176 renormalized
    (dict(top_k=2, top_p=0.9), {0, 1}),
    (dict(), {0, 1, 2, 3, 4}),
])
def test_top_k_top_p_masks_are_exact(kw, kept):
    logits = logits_of(PROBS)[None, :]
    rows = _rows([sp(**kw)], [0], [0], len(PROBS))
    values, ids = _filter_candidates(logits, rows)
    assert {int(i) for v, i in zip(values[0], ids[0]) if v > float("-inf")} == kept


def test_filtered_draws_stay_inside_the_kept_set():
    logits = logits_of(PROBS)[None, :].repeat(400, 1)
    tokens = Sampler().sample(logits, [sp(top_k=3, top_p=0.6)] * 400, list(range(400)))
    assert set(tokens) == {0, 1}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.6, 0), (1.7, 0), (1.0, 4)])
def test_empirical_distribution_matches_softmax(temperature, top_k):
    # 8 tokens, 16,000 draws (positions 0..15999 of one seed, 4,000 rows per call): the chi-square
    # statistic against softmax(logits / T) (renormalized over the top-k) stays under the
    # p = 0.001 critical value (24.3 for 7 degrees of freedom, 16.3 for 3). Deterministic.
    logits = torch.tensor([1.5, 0.3, -0.4, 0.9, 0.0, -1.2, 2.0, 0.5])
    scaled = logits / temperature
    if top_k:
        scaled = scaled.masked_fill(scaled < scaled.topk(top_k).values[-1], float("-inf"))
    expect = torch.softmax(scaled, -1).tolist()
    counts = [0] * 8
    sampler, params = Sampler(), [sp(temperature=temperature, top_k=top_k, seed=11)] * 4000
    for start in range(0, 16_000, 4000):
        for t in sampler.sample(logits[None, :].repeat(4000, 1), params,
                                list(range(start, start + 4000))):
            counts[t] += 1
    support = [i for i, p in enumerate(expect) if p > 0]
    assert all(counts[i] == 0 for i in range(8) if i not in support)
    stat = chi_square([counts[i] for i in support], [expect[i] for i in support])
    assert stat < (24.3 if len(support) == 8 else 16.3), (counts, expect)
    # a wrong temperature is detected: the statistic against softmax(logits) is far larger
    if temperature != 1.0:
        wrong = torch.softmax(logits, -1).tolist()
        assert chi_square(counts, wrong) > 100


MIXED = [sp(temperature=0.0), sp(seed=1), sp(seed=2, top_k=50), sp(seed=3, top_p=0.8),
         sp(seed=4, temperature=0.5, top_k=10, top_p=0.9), sp(temperature=0.0),
         sp(seed=6, temperature=1.3)]


@pytest.mark.parametrize("target", [sp(seed=9), sp(seed=9, top_p=0.9), sp(seed=9, top_k=20),
                                    sp(seed=9, top_k=30, top_p=0.95, temperature=0.7)])
def test_same_seed_same_token_alone_or_in_a_batch_of_eight(target):
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler()
    for pos in range(40):
        logits = torch.randn(8, 1000, generator=gen) * 3
        alone = sampler.sample(logits[3:4], [target], [pos])
        batch = sampler.sample(logits, MIXED[:3] + [target] + MIXED[3:],
                               [pos + 7 * i for i in range(8)][:3] + [pos] + [pos + 1] * 4)
        assert batch[3] == alone[0]


def test_greedy_rows_are_argmax_in_a_mixed_batch():
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(1))
    tokens = Sampler().sample(logits, MIXED, [0] * 7)
    assert tokens[0] == int(logits[0].argmax()) and tokens[5] == int(logits[5].argmax())


def stream(seed: int, choice: int, n: int = 64) -> list[int]:
    logits = torch.zeros(n, 1000)  # uniform: every token equally likely
    return Sampler().sample(logits, [sp(seed=seed)] * n, list(range(n)), [choice] * n)


def test_different_seeds_and_choices_give_different_streams():
    base = stream(1, 0)
    assert base == stream(1, 0)
    for other in (stream(2, 0), stream(1, 1), stream(1 + 2**64, 1)):
        assert sum(a == b for a, b in zip(base, other)) < 5   # 64 draws from 1000: ~0 equal
    assert stream(1 + 2**64, 0) == base          # seeds are taken modulo 2**64
    assert len(set(base)) > 50                   # positions give fresh draws


def test_sampled_row_without_seed_is_refused():
    with pytest.raises(ValueError, match="seed"):
        Sampler().sample(torch.zeros(1, 10), [SamplingParams(temperature=1.0)], [0])


def test_position_matters_with_a_peaked_distribution_too():
    # tokens 0 and 1 at 50/50: over 200 positions both appear, in the proportion expected
    logits = torch.tensor([[0.0, 0.0] + [-math.inf] * 8]).repeat(200, 1)
    tokens = Sampler().sample(logits, [sp(seed=3)] * 200, list(range(200)))
    assert set(tokens) == {0, 1} and 70 < tokens.count(0) < 130


@pytest.mark.parametrize("shape, slab", [((8, 1000), 1000), ((8, 1000), 2500), ((3, 7), 1),
                                         ((5, 300), 1 << 16)])
def test_slabbed_gumbel_argmax_equals_the_plain_formula(shape, slab):
    gen = torch.Generator().manual_seed(2)
    scores = torch.randn(*shape, generator=gen)
    scores[0, :2] = float("-inf")
    keys = torch.randint(-2**62, 2**62, (shape[0],), generator=gen)
    for ids in (torch.arange(shape[1]), torch.randint(0, 10**6, shape, generator=gen)):
        want = torch.argmax(scores + gumbel(keys, ids), dim=-1)
        assert torch.equal(gumbel_argmax(scores, keys, ids, slab_elements=slab), want)
