"""The plain-greedy sampling fast path (ModelRunner.sample_with_logprobs: one argmax, one host read)
gives the general path's picks, and every row it must not take (logprobs, penalties, logit_bias,
min_tokens, a fork, a sampled row) still goes the general way."""
import pytest
import torch

from engine.model_runner import _plain_greedy
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(max_tokens=4, temperature=0.0),
    "greedy_logprobs": SamplingParams(max_tokens=4, temperature=0.0, logprobs=2),
    "greedy_penalty": SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3),
    "greedy_bias": SamplingParams(max_tokens=4, temperature=0.0, logit_bias={5: 100.0}),
    "greedy_min_tokens": SamplingParams(max_tokens=4, temperature=0.0, min_tokens=2),
    "greedy_fork": SamplingParams(max_tokens=4, temperature=0.0),  # n = 2 on the request
    "sampled": SamplingParams(max_tokens=4, temperature=0.8, seed=1),
}
PLAIN = {"greedy"}


@pytest.fixture(scope="module")
def engine(tiny_engine_factory):
    return tiny_engine_factory()


def _seqs(engine, names):
    for name in names:
        engine.add_request(EngineRequest(request_id=name, prompt_token_ids=[3, 4, 5], sampling=CASES[name],
                                         n=2 if name == "greedy_fork" else 1))
    seqs = [s for s in engine.scheduler.waiting if s.request_id in names]
    for name in names:
        engine.abort_request(name)
    engine.step()
    return seqs


def test_only_plain_greedy_rows_take_the_fast_path(engine):
    seqs = _seqs(engine, list(CASES))
    assert {s.request_id for s in seqs if _plain_greedy(s)} == PLAIN


@pytest.mark.parametrize("names", [["greedy"], list(CASES), ["greedy", "greedy_logprobs"], ["greedy_bias"]])
def test_fast_path_picks_equal_the_general_path(engine, names):
    seqs = _seqs(engine, names)
    gen = torch.Generator().manual_seed(len(names))
    logits = torch.randn(len(seqs), engine.model_config.vocab_size, generator=gen)
    logits[:, 7] = logits.max() + 1.0  # a clear argmax, and ties elsewhere
    logits[:, 9] = logits[:, 7]
    picks = []
    for fast in (True, False):
        engine.runner.fast_greedy = fast
        picks.append(engine.runner.sample_with_logprobs(seqs, logits))
    engine.runner.fast_greedy = True
    assert picks[0] == picks[1]
    if "greedy_bias" in names:  # the general path applied the bias
        assert picks[0][("greedy_bias", 0)][0][0] == 5
    if "greedy" in names:
        assert picks[0][("greedy", 0)] == [(int(torch.argmax(logits[names.index("greedy")])), None)]


def test_engine_greedy_tokens_same_on_both_paths(tiny_engine_factory):
    outs = []
    for fast in (True, False):
        engine = tiny_engine_factory()
        engine.runner.fast_greedy = fast
        for i, n in enumerate((3, 17, 30)):
            engine.add_request(EngineRequest(request_id=f"r{i}", prompt_token_ids=list(range(11, 11 + n)),
                                             sampling=SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        while engine.has_work():
            for out in engine.step().outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outs.append(tokens)
    assert outs[0] == outs[1]
