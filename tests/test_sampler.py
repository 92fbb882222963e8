"""Sampling rules on hand-made logits, against numpy written out by hand."""
import numpy as np
import pytest

from trtllm_lite.sampler import Sampler, SamplingRow
from trtllm_lite.sampling_params import SamplingParams


def row(prompt=(), output=(), stop_ids=(), seed=None, **kw):
    p = SamplingParams(seed=seed, **kw)
    gen = np.random.default_rng(seed) if seed is not None else None
    return SamplingRow(p, gen, list(prompt), list(output), tuple(stop_ids))


def processed(logits, r):
    return Sampler(0).process_logits(np.array([logits], np.float32), [r])[0]


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output():
    x = processed([2.0, -2.0, 2.0, -2.0, 1.0], row(prompt=[0, 1], output=[2], repetition_penalty=2.0))
    np.testing.assert_allclose(x, [1.0, -4.0, 1.0, -2.0, 1.0])   # token 3 unseen, 4 unseen


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("penalty", [1e308, 3.5e38, 1e-308, 1e-45])
@pytest.mark.parametrize("temperature", [1.0, 0.8, 0.01])
def test_extreme_repetition_penalty_samples_without_overflow(penalty, temperature):
    """Any finite penalty > 0 is accepted: no numpy overflow warning, no NaN, and the row is
    still sampled, not silently greedy (found by QA: 1e308 overflowed float32; a tiny penalty
    with temperature < 1 overflowed the division by T and fell back to greedy)."""
    logits = np.array([[3.0, -2.0, 0.0, 1.0, 3.0]], np.float32)
    r = row(prompt=[0, 1], output=[2, 4], repetition_penalty=penalty, temperature=temperature, logprobs=2)
    x = processed(logits[0], r)
    assert not np.isnan(x).any() and np.isfinite(x[[0, 2, 3, 4]]).all()
    assert x[3] == 1.0                                     # unseen: untouched
    drawn = set()
    for seed in range(40):
        r = row(prompt=[0, 1], output=[2, 4], repetition_penalty=penalty, temperature=temperature, seed=seed,
                logprobs=2)
        tokens, logprobs = Sampler(0)(logits.copy(), [r])
        assert np.isfinite(logprobs[0].logprob)
        drawn.add(int(tokens[0]))
    if penalty < 1:    # tokens 0 and 4 pushed to the top together: sampled, both drawn
        assert drawn == {0, 4}


def test_presence_and_frequency_count_output_tokens_only():
    x = processed([1.0, 1.0, 1.0, 1.0], row(prompt=[0, 0, 3], output=[1, 1, 2],
                                            presence_penalty=0.5, frequency_penalty=0.25))
    np.testing.assert_allclose(x, [1.0, 1.0 - 0.5 - 0.5, 1.0 - 0.5 - 0.25, 1.0])


def test_logit_bias_and_min_tokens_suppress_eos():
    x = processed([0.0, 5.0, 1.0], row(output=[2], logit_bias={2: 10.0}, min_tokens=3, stop_ids=(1,)))
    assert x[1] == -np.inf and x[2] == 11.0


def test_greedy_variants_all_give_argmax_and_never_nan():
    logits = np.array([[1.0, 3.0, 3.0, 0.5]] * 5, np.float32)   # tied maxima at 1 and 2
    rows = [row(temperature=0.0), row(top_k=1, temperature=1.0, seed=1), row(top_p=1e-9, seed=2),
            row(temperature=1e-6, seed=3), row(top_k=1, top_p=0.5, seed=4)]
    for _ in range(20):
        tokens, _ = Sampler(0)(logits, rows)
        assert tokens.tolist() == [1] * 5


def test_top_k_and_top_p_restrict_the_support():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    seen_k, seen_p = set(), set()
    sampler = Sampler(0)
    for seed in range(300):
        seen_k.add(int(sampler(logits, [row(top_k=2, seed=seed)])[0][0]))
        seen_p.add(int(sampler(logits, [row(top_p=0.8, seed=seed)])[0][0]))
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}          # 0.5 + 0.3 reaches 0.8
    full = {int(sampler(logits, [row(top_p=1.0, seed=s)])[0][0]) for s in range(300)}
    assert full == {0, 1, 2, 3}


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = np.log(np.array([[0.6, 0.3, 0.08, 0.02]], np.float32))
    seen = {int(Sampler(0)(logits, [row(min_p=0.2, seed=s)])[0][0]) for s in range(300)}
    assert seen == {0, 1}            # 0.08 < 0.2 * 0.6


def test_sampling_frequencies_follow_the_distribution():
    p = np.array([0.5, 0.3, 0.2])
    logits = np.log(p).astype(np.float32)[None].repeat(4000, 0)
    tokens, _ = Sampler(0)(logits, [row(temperature=1.0)] * 4000)
    freq = np.bincount(tokens, minlength=3) / 4000
    np.testing.assert_allclose(freq, p, atol=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    alone = Sampler(1)(logits[2:3], [row(seed=7)])[0][0]
    mixed_rows = [row() for _ in range(6)]
    mixed_rows[2] = row(seed=7)
    mixed = Sampler(99)(logits, mixed_rows)[0][2]
    assert alone == mixed


def test_logprobs_are_of_the_sampled_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    tokens, lps = Sampler(0)(logits, [row(top_k=2, temperature=1.0, logprobs=3, seed=0)])
    lp = lps[0]
    np.testing.assert_allclose(np.exp(lp.logprobs[:2]), [0.5 / 0.8, 0.3 / 0.8], rtol=1e-5)
    assert lp.logprobs[2] == -np.inf                    # masked by top_k
    assert lp.rank in (1, 2) and lp.token_ids[0] == 0
    greedy_tokens, greedy_lps = Sampler(0)(logits, [row(temperature=0.0, logprobs=1)])
    np.testing.assert_allclose(greedy_lps[0].logprob, np.log(0.5), rtol=1e-5)


@pytest.mark.parametrize("kw,name", [(dict(min_p=1.5), "min_p"), (dict(repetition_penalty=0.0), "repetition_penalty"),
                                     (dict(presence_penalty=3.0), "presence_penalty"),
                                     (dict(frequency_penalty=-2.5), "frequency_penalty"),
                                     (dict(n=0), "n"), (dict(min_tokens=20, max_tokens=10), "min_tokens"),
                                     (dict(stop=[""]), "stop"), (dict(logprobs=-1), "logprobs"),
                                     (dict(logit_bias={1: 1000}), "logit_bias"), (dict(temperature=float("nan")), "temperature"),
                                     (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(stop=123), "stop"),
                                     (dict(bad_words=5), "bad_words")])
def test_out_of_range_values_name_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_bad_words_forbid_their_last_token_after_their_prefix():
    r = row(output=[5, 6])
    r.bad_words_ids = ((3,), (6, 2), (9, 4))
    x = processed([1.0] * 10, r)
    assert x[3] == -np.inf and x[2] == -np.inf     # single-token word; prefix [6] matches the output's end
    assert x[4] == 1.0                              # prefix [9] does not


def test_huge_temperature_samples_uniformly_without_overflow():
    logits = np.array([[1.0, 3.0, -np.inf, 0.5]], np.float32)      # token 2 forbidden (bad word, bias)
    rows = [row(temperature=1e308, seed=s) for s in range(400)]
    with np.errstate(all="raise"):
        tokens, _ = Sampler(0)(np.repeat(logits, 400, axis=0), rows)
    counts = np.bincount(tokens, minlength=4)
    assert counts[2] == 0 and counts.min(initial=400, where=[True, True, False, True]) > 100


def test_sampling_leaves_the_callers_logits_unchanged():
    """The sampler reads the step's logits in place when no row changes them and copies them
    when one does: either way the caller's array is unchanged, and every row's token is the one
    it gets alone (a penalty, bias or min_tokens row must not reach its neighbours)."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((5, 40)).astype(np.float32)
    logits[:, 7] = 4.0                          # every row's argmax unless processed
    makers = [lambda: row(temperature=0.0), lambda: row(prompt=[7], repetition_penalty=100.0, temperature=0.0),
              lambda: row(logit_bias={7: -50.0}, temperature=0.0),
              lambda: row(output=[1], min_tokens=3, stop_ids=(7,), temperature=0.0),
              lambda: row(seed=4, temperature=0.7, logprobs=2)]
    for picked in ([0, 1, 2, 3, 4], [0, 4]):    # with rows that change logits, and without
        x = logits[picked].copy()
        before = x.copy()
        tokens, _ = Sampler(0)(x, [makers[i]() for i in picked])
        np.testing.assert_array_equal(x, before)
        alone = [Sampler(0)(x[j:j + 1].copy(), [makers[i]()])[0][0] for j, i in enumerate(picked)]
        assert tokens.tolist() == alone
        if len(picked) == 5:
            assert tokens[0] == 7 and 7 not in tokens[1:4].tolist()
