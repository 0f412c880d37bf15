"""Logits processors and min_p against their documented formulas (and HF's repetition penalty),
batched: each row gets exactly what it would get alone, and rows without them are untouched."""
import math

import pytest
import torch

from engine.logits_processors import process_logits
from engine.logprob_math import token_logprobs
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams

V = 11
EOS = [2]


def sp(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "seed": 1, **kw})


def test_frequency_and_presence_follow_openai_formula():
    logits = torch.randn(2, V)
    params = [sp(frequency_penalty=0.5, presence_penalty=0.25), sp()]
    out_ids = [3, 3, 7]
    got = process_logits(logits, params, [([], out_ids), ([], [])], EOS)
    want = logits[0].clone()
    for v in range(V):
        c = out_ids.count(v)
        want[v] -= 0.5 * c + 0.25 * (c > 0)
    assert torch.allclose(got[0], want) and torch.equal(got[1], logits[1])


def test_repetition_penalty_equals_hf_processor():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, V)
    prompt, out = [1, 4], [4, 9]
    got = process_logits(logits, [sp(repetition_penalty=1.7)], [(prompt, out)], EOS)
    hf = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([prompt + out]), logits.clone())
    assert torch.allclose(got, hf)


def test_logit_bias_and_min_tokens():
    logits = torch.zeros(2, V)
    params = [sp(logit_bias={5: 3.0, 6: -100.0}), sp(min_tokens=2, stop_token_ids=[8, 10**9])]
    got = process_logits(logits, params, [([], []), ([], [0])], EOS)
    assert got[0, 5] == 3.0 and got[0, 6] == -100.0 and got[0].sum() == -97.0
    assert math.isinf(got[1, 2]) and math.isinf(got[1, 8]) and got[1].isinf().sum() == 2
    met = process_logits(logits[1:], params[1:], [([], [0, 1])], EOS)  # two output tokens: min_tokens met
    assert torch.equal(met, logits[1:])


def test_processors_change_greedy_and_off_is_the_same_tensor():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    s = Sampler(EOS)
    assert s.sample(logits, [sp()], [0]) == [1]
    assert s.sample(logits, [sp(logit_bias={3: 2.0})], [0], history=[([], [])]) == [3]
    assert s.sample(logits, [sp(frequency_penalty=2.0)], [1], history=[([], [1])]) == [3]
    assert process_logits(logits, [sp()], [([], [])], EOS) is logits  # nothing applies: not even a copy
    with pytest.raises(ValueError, match="history"):
        s.sample(logits, [sp(presence_penalty=1.0)], [0])


def test_min_p_drops_unlikely_tokens_and_keeps_the_rest():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    s = Sampler()
    seen = {s.sample(probs.log(), [sp(temperature=1.0, seed=seed, min_p=0.2)], [0])[0] for seed in range(300)}
    assert seen == {0, 1, 2}  # 0.05 < 0.2 * 0.5; 0.15 >= 0.1 stays
    seen = {s.sample(probs.log(), [sp(temperature=1.0, seed=seed)], [0])[0] for seed in range(300)}
    assert seen == {0, 1, 2, 3}


def test_token_logprobs_are_log_softmax_with_top_k():
    logits = torch.randn(3, V)
    chosen = torch.tensor([0, 5, 10])
    entries = token_logprobs(logits, chosen, [0, 2, 4])
    lp = torch.log_softmax(logits, -1)
    for r, e in enumerate(entries):
        assert e.token_id == chosen[r].item() and e.logprob == pytest.approx(lp[r, chosen[r]].item(), abs=1e-6)
        top = lp[r].topk(len(e.top))
        assert [t for t, _ in e.top] == top.indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-6)
    assert [len(e.top) for e in entries] == [0, 2, 4]


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=-2.1), dict(repetition_penalty=0),
                                dict(min_p=1.5), dict(min_tokens=5, max_tokens=4), dict(logit_bias={1: 101.0}),
                                dict(logprobs=21)])
def test_out_of_range_is_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw).validate()
