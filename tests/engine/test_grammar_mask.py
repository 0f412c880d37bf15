"""Grammar compilation, matchers and token masks (engine.structured_output, engine.grammar_mask),
on the SmolLM2 vocabulary (49,152 tokens) the tiny test model shares."""
from __future__ import annotations

import pytest
import torch

from engine.grammar_mask import _unpack, apply_grammar, grammar_rows
from engine.structured_output import GrammarCompiler, GrammarError, TokenRejected
from pdserve.structured_output import StructuredOutputSpec

CHOICE = StructuredOutputSpec(kind="choice", choices=("yes", "no"))


@pytest.fixture(scope="module")
def tok(tiny_engine):
    return tiny_engine.tokenizer


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler(tok, 49152, tok.eos_token_ids)


def allowed_ids(compiler: GrammarCompiler, matcher) -> list[int]:
    g = grammar_rows([matcher], compiler.vocab_size, torch.device("cpu"))
    return g.allowed[0].nonzero().flatten().tolist()


@pytest.mark.parametrize("spec, match", [
    (StructuredOutputSpec(kind="json_schema", json_schema={"type": "strnig"}), "strnig"),
    (StructuredOutputSpec(kind="json_schema", json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
     "nope"),
    (StructuredOutputSpec(kind="regex", regex="(ab"), "regex"),
    (StructuredOutputSpec(kind="grammar", grammar="start: missing_rule"), "missing_rule"),
])
def test_what_the_library_cannot_compile_is_a_grammar_error_that_says_why(compiler, spec, match):
    with pytest.raises(GrammarError, match=match):
        compiler.compile(spec)
    with pytest.raises(GrammarError):
        compiler.matcher(spec)


def test_compiled_grammars_are_cached_by_spec(tok):
    c = GrammarCompiler(tok, 49152, tok.eos_token_ids, cache_size=2)
    specs = [StructuredOutputSpec(kind="regex", regex=f"a{{{n}}}") for n in (1, 2, 3)]
    first = c.compile(specs[0])
    assert c.compile(StructuredOutputSpec(kind="regex", regex="a{1}")) is first  # an equal spec: the cache
    c.compile(specs[1])
    c.compile(specs[2])  # evicts specs[0] (least recently used)
    assert c.compile(specs[0]) is not first and c.compile(specs[0]) == first


def test_choice_allows_only_prefixes_of_the_choices(compiler, tok):
    m = compiler.matcher(CHOICE)
    ids = allowed_ids(compiler, m)
    assert tok.encode("yes")[0] in ids and tok.encode("no")[0] in ids
    texts = [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert all("yes".startswith(s) or "no".startswith(s) for s in texts), texts
    assert not set(tok.eos_token_ids) & set(ids)  # nothing is a choice yet: no EOS


def test_a_complete_choice_allows_only_eos(tok):
    eos = [2, 0]  # two EOS ids: the library knows one, the other shares its bit
    c = GrammarCompiler(tok, 49152, eos)
    m = c.matcher(CHOICE, tok.encode("yes"))
    assert m.stopped and m.accepting
    assert allowed_ids(c, m) == sorted(eos)
    assert m.accept(0) and not m.error  # the other EOS id is consumed as the library's


def test_matcher_replays_tokens_and_refuses_one_the_grammar_breaks(compiler, tok):
    m = compiler.matcher(CHOICE, tok.encode("n"))
    ids = allowed_ids(compiler, m)
    assert not m.stopped and ids and all(tok.decode([t]) == "o" for t in ids)
    with pytest.raises(TokenRejected, match="token 0"):
        compiler.matcher(CHOICE, tok.encode("maybe"))


def test_unpack_reads_bit_t_mod_32_of_word_t_div_32():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32, generator=g)
    vocab = 150
    got = _unpack(bits, vocab)
    want = [[bool((int(bits[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
    assert got.tolist() == want


def test_apply_grammar_masks_only_constrained_rows_and_greedy_is_argmax_over_allowed(compiler, tok):
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(1))
    g = grammar_rows([None, compiler.matcher(CHOICE), None], 49152, torch.device("cpu"))
    out = apply_grammar(logits, g)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = g.allowed[0]
    assert torch.isneginf(out[1][~allowed]).all() and torch.equal(out[1][allowed], logits[1][allowed])
    best = int(out[1].argmax())
    assert allowed[best] and logits[1][best] == logits[1][allowed].max()
    assert torch.equal(logits, logits.clone())  # the input is never written


def test_a_row_the_processors_left_without_any_allowed_token_takes_its_fallback(compiler, tok):
    """min_tokens bans EOS while a finished grammar allows only EOS: the grammar's end wins."""
    raw = torch.zeros(1, 49152)
    processed = raw.clone()
    processed[0, tok.eos_token_ids] = float("-inf")
    g = grammar_rows([compiler.matcher(CHOICE, tok.encode("yes"))], 49152, torch.device("cpu"))
    out = apply_grammar(processed, g, raw)
    assert int(out[0].argmax()) in tok.eos_token_ids


def test_noise_is_finite_where_the_24_bit_uniform_rounds_to_one():
    """(2**24 - 0.5) / 2**24 is 1.0 in float32: its Gumbel noise was +inf, so that token won whatever
    its logit, and a masked (-inf) token gave NaN, which argmax picks. Seed 43, output position 3
    (the SmolLM2 acceptance run's first invalid JSON) hits it inside the 49,152-token vocabulary."""
    from engine.counter_rng import _gumbel_, gumbel, stream_keys

    keys = stream_keys(torch.tensor([43]), torch.tensor([0]), torch.tensor([3]))
    for noise in (gumbel(keys, torch.arange(49152)), _gumbel_(keys.clone(), torch.arange(49152))):
        assert torch.isfinite(noise).all()
    logits = torch.zeros(1, 49152)
    allowed = torch.zeros(1, 49152, dtype=torch.bool)
    allowed[0, :28] = True
    from engine.grammar_mask import GrammarRows
    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams

    pick = Sampler([2]).sample_ids(logits, [SamplingParams(temperature=1.0, seed=43)], [3], [0], None,
                                   GrammarRows([0], allowed))
    assert int(pick) < 28
