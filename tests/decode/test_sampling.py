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


@pytest.mark.parametrize("kw", [dict(temperature=-1, top_k=None, top_p=None), dict(temperature=1, top_k=0, top_p=None),
                                dict(temperature=1, top_k=None, top_p=0.0), dict(temperature=1, top_k=None, top_p=1.5)])
def test_bad_sampling_args(kw):
    with pytest.raises(ValueError, match="must be"):
        validate_sampling_args(**kw)
