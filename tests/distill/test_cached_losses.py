"""Invariants of the losses on a cached top-k + tail target (distill.losses.cached_divergence): exact against the
full-vocabulary loss when k = V, never negative, exactly 0 for identical inputs, never above the full loss
(data-processing inequality), a stable tail, finite gradients, masking and exact token-count division."""
import math

import pytest
import torch

from distill.losses import (bucket_log_probs, cached_distill_loss, cached_divergence, distill_loss, topk_buckets)

NAMES = ["fkl", "rkl", "jsd", "tvd"]
V = 50


def _logits(seed, shape=(3, 7, V), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def _cache(target_logits, k, temperature=1.0, dtype=torch.float32):
    top, ids, tail = topk_buckets(target_logits, k, temperature)
    return torch.cat([top, tail.unsqueeze(-1)], -1).to(dtype), ids.int()


@pytest.mark.parametrize("name,beta", [("fkl", 0.5), ("rkl", 0.5), ("jsd", 0.5), ("jsd", 0.2), ("jsd", 0.0),
                                       ("jsd", 1.0), ("tvd", 0.5)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_k_equal_vocab_is_the_full_loss_value_and_gradient(name, beta, temperature):
    d, t = _logits(0), _logits(1)
    m = torch.ones(3, 7)
    m[0, :3] = 0
    n = int(m.sum())
    log_p, ids = _cache(t, V, temperature)
    d1 = d.clone().requires_grad_(True)
    cached = cached_divergence(name, d1, log_p, ids, m, n, beta=beta, temperature=temperature)
    d2 = d.clone().requires_grad_(True)
    full = distill_loss(name, d2, t, m, n, beta=beta, temperature=temperature)
    cached.backward(), full.backward()
    assert cached.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    assert torch.allclose(d1.grad, d2.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("k", [1, 4, V])
def test_identical_inputs_give_exactly_zero(name, k):
    x = _logits(2)
    m = torch.ones(3, 7)
    log_p, ids = _cache(x, k)
    assert cached_divergence(name, x, log_p, ids, m, 21, beta=0.3).item() == 0.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("k", [1, 3, 8, 20])
def test_nonnegative_and_at_most_the_full_loss(name, k):
    for seed in range(5):
        d, t = _logits(10 + seed), _logits(20 + seed)
        m = torch.ones(3, 7)
        full = distill_loss(name, d, t, m, 21).item()
        log_p, ids = _cache(t, k)
        cached = cached_divergence(name, d, log_p, ids, m, 21).item()
        assert 0.0 <= cached <= full + 1e-6
        # fp16 storage (the cache's format) stays non-negative and close to the fp32 entry
        log_p16 = log_p.half()
        c16 = cached_divergence(name, d, log_p16, ids, m, 21).item()
        assert c16 >= 0.0
        assert c16 == pytest.approx(cached, rel=2e-2, abs=2e-3)


def test_coarse_loss_approaches_full_as_k_grows():
    d, t = _logits(3), _logits(4)
    m = torch.ones(3, 7)
    values = [cached_divergence("fkl", d, *_cache(t, k), m, 21).item() for k in (1, 4, 16, V)]
    assert values == sorted(values)  # nested partitions: a finer one never has a smaller divergence
    assert values[-1] == pytest.approx(distill_loss("fkl", d, t, m, 21).item(), rel=1e-5)


def test_tail_is_stable_for_tiny_mass():
    logits = torch.full((1, V), -80.0)
    logits[0, :3] = torch.tensor([10.0, 9.0, 8.0])  # tail mass ≈ 47·e^-90 ≈ 1e-37
    b = bucket_log_probs(logits, torch.tensor([[0, 1, 2]]))
    ref = torch.logsumexp(logits[0, 3:].double(), 0) - torch.logsumexp(logits[0].double(), 0)
    assert math.isfinite(b[0, 3].item())
    assert b[0, 3].item() == pytest.approx(ref.item(), rel=1e-6)  # log1p(-Σp) would give -inf (or log 0)


@pytest.mark.parametrize("name", NAMES)
def test_finite_gradients_with_minus_inf_logits_and_full_k(name):
    d, t = _logits(5), _logits(6)
    d[..., -5:] = float("-inf")  # a draft lm_head smaller than the shared vocabulary is padded with -inf
    m = torch.ones(3, 7)
    for k in (4, V):
        log_p, ids = _cache(t, k)
        x = d.clone().requires_grad_(True)
        loss = cached_divergence(name, x, log_p, ids, m, 21)
        loss.backward()
        assert math.isfinite(loss.item()) and loss.item() >= 0
        assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", NAMES)
def test_masked_positions_contribute_nothing_even_with_garbage(name):
    d, t = _logits(7), _logits(8)
    m = torch.ones(3, 7)
    m[1, 2:] = 0
    log_p, ids = _cache(t, 5)
    ref = cached_divergence(name, d, log_p, ids, m, 10.0)
    dg, lg, ig = d.clone(), log_p.clone(), ids.clone()
    off = ~m.bool()
    dg[off] = float("nan")
    lg[off] = float("nan")
    ig[off] = -1
    x = dg.clone().requires_grad_(True)
    got = cached_divergence(name, x, lg, ig, m, 10.0)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-6)
    assert torch.isfinite(x.grad).all() and (x.grad[off] == 0).all()


def test_accumulation_is_exact():
    d, t = _logits(9), _logits(11)
    m = torch.ones(3, 7)
    log_p, ids = _cache(t, 6)
    whole = cached_divergence("jsd", d, log_p, ids, m, 21)
    halves = sum(cached_divergence("jsd", d[i:i + 1], log_p[i:i + 1], ids[i:i + 1], m[i:i + 1], 21) for i in range(3))
    assert whole.item() == pytest.approx(halves.item(), rel=1e-6)


def test_ce_mixing_and_errors():
    d, t = _logits(12), _logits(13)
    m = torch.ones(3, 7)
    log_p, ids = _cache(t, 4)
    labels = torch.randint(0, V, (3, 7), generator=torch.Generator().manual_seed(0))
    div = cached_divergence("tvd", d, log_p, ids, m, 21)
    mixed = cached_distill_loss("tvd", d, log_p, ids, m, 21, labels=labels, ce_weight=0.25)
    ce = torch.nn.functional.cross_entropy(d.reshape(-1, V), labels.reshape(-1))
    assert mixed.item() == pytest.approx(0.75 * div.item() + 0.25 * ce.item(), rel=1e-5)
    with pytest.raises(ValueError, match="tail bucket"):
        cached_divergence("fkl", d, log_p[..., :-1], ids, m, 21)
    with pytest.raises(ValueError, match="unknown loss"):
        cached_divergence("kl", d, log_p, ids, m, 21)
    with pytest.raises(ValueError, match="beta"):
        cached_divergence("jsd", d, log_p, ids, m, 21, beta=2.0)
    with pytest.raises(ValueError, match="needs labels"):
        cached_distill_loss("fkl", d, log_p, ids, m, 21, ce_weight=0.5)
    with pytest.raises(ValueError, match="logit_cache_k"):
        topk_buckets(t, V + 1)
