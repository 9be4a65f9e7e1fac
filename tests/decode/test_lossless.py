"""End-to-end losslessness: the joint distributions of the 1st and 2nd, and of the 2nd and 3rd generated tokens at a
fixed prefix must be the target's own (after penalties/temperature/top-k/top-p/min-p), whatever the draft. The 1st
token comes from the target's prefill, the 2nd and 3rd from the first speculative step (its window's 1st and 2nd
positions). Chi-square goodness of fit on 20k rows."""
import math

import pytest
import torch

from decode import SpeculativeDecoder
from decode.sampling import logits_to_probs
from tests.conftest import perturbed_copy, tiny_llama

V = 8
N = 20_000
PROMPT = [1, 5, 3, 6]


def small_vocab_llama(seed, layers):
    model = tiny_llama(vocab_size=V, seed=seed, layers=layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # undo most of the fixture's sharpening: keep mass on many ids
    return model


@torch.no_grad()
def joints(probs):
    """The exact ``(V, V)`` joints p(x1, x2 | PROMPT) and p(x2, x3 | PROMPT) (x1 summed out), from ``probs(seqs)``:
    the next-token distributions ``(B, V)`` after each row of ``seqs`` ``(B, T)``."""
    p1 = probs(torch.tensor([PROMPT]))[0]
    p2 = probs(torch.tensor([PROMPT + [a] for a in range(V)]))  # [x1, x2]
    p3 = probs(torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])).view(V, V, V)
    j12 = p1[:, None] * p2
    return j12, (j12[:, :, None] * p3).sum(0)


def exact_joints(model, temperature, top_k, top_p):
    """:func:`joints` under the processed sampling distribution."""
    return joints(lambda seqs: logits_to_probs(model(seqs).logits[:, -1], temperature, top_k, top_p))


def chi_square(counts, expected):
    """Chi-square statistic over cells with expected > 0, and its degrees of freedom."""
    m = expected > 0
    return float(((counts[m] - expected[m]) ** 2 / expected[m]).sum()), int(m.sum()) - 1


def critical(df):
    """A bound the statistic exceeds with probability well under 1e-4 for a correct sampler
    (Wilson–Hilferty approximation of the chi-square quantile at z = 4)."""
    z = 4.0
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def joint_counts(out, i):
    """Counts ``(V, V)`` of the pairs of new tokens at positions i and i + 1."""
    pairs = torch.stack([t[i:i + 2] for t in out.new_tokens])
    return torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).view(V, V).double()


def fits(out, expected):
    """Whether both joints of ``out`` pass the chi-square test against ``expected`` (the two (V, V) joints times N),
    and no pair of probability 0 was sampled."""
    for i, e in enumerate(expected):
        counts = joint_counts(out, i)
        if counts[e == 0].sum() > 0 or chi_square(counts, e)[0] >= critical(chi_square(counts, e)[1]):
            return False
    return True


@pytest.fixture(scope="module")
def models():
    target = small_vocab_llama(seed=0, layers=2)
    return target, {"unrelated": small_vocab_llama(seed=7, layers=1), "perturbed": perturbed_copy(target, 1.0, seed=3)}


@pytest.mark.parametrize("temperature,top_k,top_p,draft_kind,gamma", [
    (1.0, None, None, "unrelated", 2), (1.0, None, None, "perturbed", 3), (0.7, None, None, "unrelated", 3),
    (0.7, None, None, "perturbed", 1), (1.0, 4, None, "perturbed", 2), (0.7, None, 0.8, "unrelated", 2),
    (1.0, 5, 0.9, "perturbed", 4)])
def test_first_two_tokens_follow_target(models, temperature, top_k, top_p, draft_kind, gamma):
    target, drafts = models
    draft = drafts[draft_kind]
    expected = [j.double() * N for j in exact_joints(target, temperature, top_k, top_p)]
    dec = SpeculativeDecoder(target, draft, num_draft_tokens=gamma)
    g = torch.Generator().manual_seed(1234)
    # γ + 2 new tokens: the prefill's token, then a full window of γ drafts
    out = dec.generate([PROMPT] * N, max_new_tokens=gamma + 2, temperature=temperature, top_k=top_k, top_p=top_p,
                       generator=g)
    for i, e in enumerate(expected):
        counts = joint_counts(out, i)
        assert counts[e == 0].sum() == 0, "sampled a pair the target's top-k/top-p gives probability 0"
        stat, df = chi_square(counts, e)
        assert stat < critical(df), (i, stat, df)
    assert 0.0 < out.stats.acceptance_rate < 1.0  # the draft really differs from the target

    # Power: the draft's own samples fail the same test, so the check above can fail.
    own = SpeculativeDecoder(draft, None, 0).generate([PROMPT] * N, max_new_tokens=3, temperature=temperature,
                                                      top_k=top_k, top_p=top_p, generator=g)
    assert not fits(own, expected)


@torch.no_grad()
def reference_joints(model, temperature=1.0, min_p=None, presence_penalty=0.0, frequency_penalty=0.0,
                     repetition_penalty=1.0):
    """:func:`joints` of the target's own sampling with these settings, built from Hugging Face's processors
    (repetition penalty over prompt + generated ids, min-p) and vLLM's presence/frequency rule over generated ids."""
    from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                        TemperatureLogitsWarper)

    def probs(seqs):
        logits = model(seqs).logits[:, -1].float()
        if repetition_penalty != 1.0:
            logits = RepetitionPenaltyLogitsProcessor(repetition_penalty)(seqs, logits)
        generated = seqs[:, len(PROMPT):]
        counts = torch.zeros(len(seqs), V).scatter_add_(1, generated, torch.ones_like(generated, dtype=torch.float))
        logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0).float()
        logits = TemperatureLogitsWarper(temperature)(seqs, logits)
        if min_p is not None:
            logits = MinPLogitsWarper(min_p)(seqs, logits)
        return logits.softmax(-1)

    return joints(probs)


@pytest.mark.parametrize("settings,gamma", [
    (dict(min_p=0.4), 3),
    (dict(presence_penalty=1.5), 2),
    (dict(frequency_penalty=-1.0, temperature=0.8), 3),
    (dict(repetition_penalty=1.8), 2),
    (dict(repetition_penalty=0.6, presence_penalty=0.7, min_p=0.3), 4),
])
def test_min_p_and_penalties_follow_target(models, settings, gamma):
    """p and q see the same counts: at window position i they include the drafts d_1..d_{i-1}."""
    target, drafts = models
    expected = [j.double() * N for j in reference_joints(target, **settings)]
    dec = SpeculativeDecoder(target, drafts["perturbed"], num_draft_tokens=gamma)
    # 4 new tokens so that γ_r >= 2: the 3rd token is often the window's 2nd draft, whose q and p count x1 and d_1.
    out = dec.generate([PROMPT] * N, max_new_tokens=4, generator=torch.Generator().manual_seed(99),
                       **{"temperature": 1.0, **settings})
    for i, e in enumerate(expected):
        counts = joint_counts(out, i)
        assert counts[e == 0].sum() == 0, "sampled a pair the setting gives probability 0"
        stat, df = chi_square(counts, e)
        assert stat < critical(df), (i, stat, df)
    assert 0.0 < out.stats.acceptance_rate < 1.0 and out.stats.accepted_length_histogram[2] > 0

    # Power: the target sampled without the setting fails the same test.
    plain = reference_joints(target, temperature=settings.get("temperature", 1.0))[1].double() * N
    e, m = expected[1], expected[1] > 0
    assert chi_square(plain[m].round(), e[m])[0] > critical(int(m.sum()) - 1) or (plain[~m] > 1).any()
