import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from decode.sampling import logits_to_probs, sample, validate_sampling_args


def hf_probs(logits, temperature, top_k, top_p):
    """Reference: Hugging Face's own warpers in generate's order (temperature, top-k, top-p)."""
    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p is not None:
        x = TopPLogitsWarper(top_p)(None, x)
    return x.softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, None, None), (1.0, 5, None),
                                                     (0.7, None, 0.8), (1.3, 10, 0.9), (1.0, None, 0.3)])
def test_matches_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = logits_to_probs(logits, temperature, top_k, top_p)
    ref = hf_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours.sum(-1), torch.ones(6))


def test_temperature_zero_is_one_hot_argmax():
    logits = torch.randn(4, 3, 20)
    probs = logits_to_probs(logits, 0.0)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(4, 3))
    assert int((probs > 0).sum()) == 12


def test_vocab_size_masks_padding_rows_and_pads_short_models():
    logits = torch.zeros(2, 10)
    logits[:, 8:] = 100.0  # padding rows that would dominate
    probs = logits_to_probs(logits, 1.0, vocab_size=8)
    assert probs.shape == (2, 8)
    torch.testing.assert_close(probs, torch.full((2, 8), 1 / 8))
    short = logits_to_probs(torch.zeros(2, 6), 1.0, vocab_size=8)
    assert short.shape == (2, 8) and torch.all(short[:, 6:] == 0)


def test_sample_uses_generator():
    probs = torch.full((1000, 16), 1 / 16)
    a = sample(probs, torch.Generator().manual_seed(3))
    b = sample(probs, torch.Generator().manual_seed(3))
    c = sample(probs, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_draw_at_the_largest_uniform_returns_the_last_id_of_positive_probability():
    """u just below 1 with unnormalised totals and trailing ids of probability 0: the draw is the last positive id
    (not a zero-probability id past it, and not the argmax)."""
    u_max = torch.tensor(1.0).nextafter(torch.tensor(0.0))  # the largest float32 below 1
    for total in (1.0, 3.0, 7.0, 1000.3, 2.0 ** 20 + 1):
        probs = torch.zeros(4, 12)
        probs[:, 0], probs[:, 7] = total * 0.75, total * 0.25  # id 0 is the argmax, id 7 the last positive id
        ids = sample(probs, u=torch.full((4,), float(u_max)))
        assert ids.tolist() == [7] * 4, (total, ids)
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    assert sample(probs, u=torch.tensor([0.0])).item() == 1 and sample(probs, u=u_max[None]).item() == 2


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_temperatures_of_one_and_above_handle_logits_near_the_float32_limit(temperature):
    """T >= 1 divides without the max shift (it cannot overflow); the distribution equals the reference's."""
    logits = torch.tensor([[3.0e38, 2.9e38, -3.0e38, float("-inf")], [1.0, 2.0, 3.0, 4.0]])
    probs = logits_to_probs(logits, temperature)
    ref = (logits.double() / temperature).softmax(-1).float()
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, ref)


@pytest.mark.parametrize("kw", [dict(temperature=-1, top_k=None, top_p=None), dict(temperature=1, top_k=0, top_p=None),
                                dict(temperature=1, top_k=None, top_p=0.0), dict(temperature=1, top_k=None, top_p=1.5),
                                # ints beyond float's range raised OverflowError (a server 500, a CLI traceback)
                                dict(temperature=1, top_k=10 ** 400), dict(temperature=10 ** 400),
                                dict(temperature=1, presence_penalty=-(10 ** 400))])
def test_bad_sampling_args(kw):
    with pytest.raises(ValueError, match="must be"):
        validate_sampling_args(**kw)


@pytest.mark.parametrize("temperature", [1e-5, 1e-40, 1e-46, 1e-300])
def test_tiny_temperature_keeps_the_top_ids_and_never_nan(temperature):
    """A valid temperature too small for float32 (1e-40 is denormal, 1e-46 rounds to 0) must not overflow logits / T
    to inf - inf = NaN (which sampled id 0, the pad token): it keeps only the ids with the largest logit."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, -5.0], [0.5, -1.0, 4.0, 0.0, 3.9]])
    probs = logits_to_probs(logits, temperature)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs, torch.tensor([[0, .5, 0, .5, 0], [0, 0, 1.0, 0, 0]]))


def test_extreme_top_p_top_k_and_penalty_saturate():
    from decode.sampling import BatchSampling, SamplingParams, probs_from_logits

    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, -5.0]])
    # a huge temperature is uniform over the real ids, not NaN from the padded -inf columns (-inf / inf)
    torch.testing.assert_close(logits_to_probs(logits, 1e39, vocab_size=7)[0, :5], torch.full((5,), 0.2))
    # top_p rounding to 0 in float32 still keeps the most likely id
    assert logits_to_probs(logits, 1.0, top_p=1e-46).tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0]]
    # a top_k beyond int64 keeps every id (no overflow when the batch's settings become tensors)
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k=10**23), logits.softmax(-1))
    # a whole-number float top_k is the integer it names (torch.topk needs an int)
    assert SamplingParams(temperature=1.0, top_k=2.0).top_k == 2
    torch.testing.assert_close(logits_to_probs(logits, 1.0, top_k=2.0), logits_to_probs(logits, 1.0, top_k=2))
    # a repetition penalty that rounds to 0 in float32 saturates: the seen positive logit (id 1) dominates
    sampling = BatchSampling([SamplingParams(temperature=1.0, repetition_penalty=1e-300)])
    seen = torch.tensor([[[False, True, False, False, False]]])
    probs = probs_from_logits(logits[None], sampling, None, torch.zeros(1, 1, 5), seen)
    assert torch.isfinite(probs).all() and probs[0, 0].argmax() == 1


@pytest.mark.parametrize("big_k", [8, 9, 10**6])
def test_each_row_keeps_its_own_top_k_when_another_row_asks_for_the_whole_vocabulary(big_k):
    """A batch mixing top_k = 1 with a top_k >= V (8 ids here) restricts the first row and not the second: each row
    equals its own settings applied alone (a top_k reaching V does not switch top-k off for the whole batch)."""
    from decode.sampling import BatchSampling, SamplingParams, probs_from_logits

    logits = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_k=big_k),
              SamplingParams(temperature=1.0, top_k=3)]
    batch = probs_from_logits(logits[[0, 1, 0]], BatchSampling(params))
    for i, (row, p) in enumerate(zip((0, 1, 0), params)):
        alone = probs_from_logits(logits[row:row + 1], BatchSampling([p]))[0]
        torch.testing.assert_close(batch[i], alone)
    assert torch.equal((batch[0] > 0).sum(-1), torch.ones(3, dtype=torch.long))  # top_k = 1: one id per position
    torch.testing.assert_close(batch[1], logits[1].softmax(-1))                  # top_k >= V: every id
    assert torch.equal((batch[2] > 0).sum(-1), torch.full((3,), 3))


def test_a_row_without_top_p_or_min_p_is_the_same_beside_rows_that_use_them():
    """Ids whose probability is below float32's resolution next to 1 (cumulative sum already 1.0) stay in a row
    without top_p beside a row that uses top_p, as they do alone; a row without min_p is not renormalised (a
    round-off change) beside a row that uses min_p."""
    from decode.sampling import BatchSampling, SamplingParams, probs_from_logits

    logits = torch.zeros(1, 1, 8)
    logits[..., 0] = 20.0  # p = 1 - 7 * 2e-9: the cumulative sum is 1.0 in float32 from the first id on
    free = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=1.0)]
    for row in free:
        alone = probs_from_logits(logits, BatchSampling([row]))
        batch = probs_from_logits(logits.expand(2, 1, 8), BatchSampling([row, SamplingParams(1.0, top_p=0.5)]))
        assert torch.equal(batch[:1], alone) and bool((alone > 0).all())
        assert batch[1].count_nonzero() == 1  # the top_p row is cut to its top id
    logits = torch.randn(1, 3, 50, generator=torch.Generator().manual_seed(1)) * 3
    for row in (SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, min_p=0.0)):
        alone = probs_from_logits(logits, BatchSampling([row]))
        batch = probs_from_logits(logits.expand(2, 3, 50), BatchSampling([row, SamplingParams(0.7, min_p=0.1)]))
        assert torch.equal(batch[:1], alone)
    # Rows with T >= 1 skip the max shift that rows with T < 1 need; beside such a row they still skip it.
    logits = torch.randn(1, 3, 50, generator=torch.Generator().manual_seed(2)) * 7 + 30
    for row in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.7)):
        alone = probs_from_logits(logits, BatchSampling([row]))
        for other in (SamplingParams(0.3), SamplingParams(0.0), SamplingParams(2.0)):
            batch = probs_from_logits(logits.expand(2, 3, 50), BatchSampling([row, other]))
            assert torch.equal(batch[:1], alone), (row, other)
            assert torch.equal(batch[1:], probs_from_logits(logits, BatchSampling([other])))
