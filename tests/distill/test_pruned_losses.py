"""Losses of a vocabulary-pruned draft (N logits over a map of target ids, q = 0 elsewhere): equal to the
full-vocabulary loss when N = V, exactly the full divergence against the pruned q where that is finite (TVD, RKL,
JSD), never negative, exactly 0 at their minimum, the documented minima when the target has mass off the map,
finite gradients, and the cached (top-k + tail) form."""
import math

import pytest
import torch

from decode.vocab_map import scatter_to_vocab
from distill.losses import (distill_loss, pruned_cached_distill_loss, pruned_cross_entropy, pruned_distill_loss,
                            cached_distill_loss, topk_buckets)

V = 40
CASES = [("fkl", 0.5), ("rkl", 0.5), ("jsd", 0.5), ("jsd", 0.2), ("jsd", 0.0), ("jsd", 1.0), ("tvd", 0.5)]
KEEP = torch.tensor([0, 2, 3, 5, 8, 13, 21, 22, 30, 39])


def _logits(seed, shape=(2, 6, V), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * scale


def _mask():
    m = torch.ones(2, 6)
    m[0, :2] = 0
    return m


@pytest.mark.parametrize("name,beta", CASES + [("acceptance", 0.5)])
@pytest.mark.parametrize("ce_weight", [0.0, 0.3])
def test_full_map_is_the_full_vocabulary_loss(name, beta, ce_weight):
    d, t, m = _logits(0), _logits(1), _mask()
    labels = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(2))
    d1, d2 = d.clone().requires_grad_(True), d.clone().requires_grad_(True)
    pruned = pruned_distill_loss(name, d1, t, torch.arange(V), m, 10, labels=labels, beta=beta, ce_weight=ce_weight,
                                 temperature=0.8)
    full = distill_loss(name, d2, t, m, 10, labels=labels, beta=beta, ce_weight=ce_weight, temperature=0.8)
    pruned.backward(), full.backward()
    assert pruned.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)
    assert torch.allclose(d1.grad, d2.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,beta", [("tvd", 0.5), ("rkl", 0.5), ("jsd", 0.5), ("jsd", 0.3), ("acceptance", 0.5)])
def test_tvd_rkl_jsd_are_the_exact_divergence_to_the_pruned_q(name, beta):
    """With q = 0 off the map they are finite and equal to the full-vocabulary divergence against the draft's
    V-wide distribution (its logits placed into a row of -inf, as the decoder does)."""
    d, t, m = _logits(3, (2, 6, len(KEEP))), _logits(4), _mask()
    pruned = pruned_distill_loss(name, d, t, KEEP, m, 10, beta=beta)
    full = distill_loss(name, scatter_to_vocab(d, KEEP, V), t, m, 10, beta=beta)
    assert math.isfinite(pruned.item()) and pruned.item() == pytest.approx(full.item(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name,beta", CASES + [("acceptance", 0.5)])
@pytest.mark.parametrize("seed", range(4))
def test_never_negative_and_finite_gradients(name, beta, seed):
    d = _logits(10 + seed, (2, 6, len(KEEP)), scale=6.0).requires_grad_(True)
    t = _logits(20 + seed, scale=6.0)
    t[0, 3, KEEP] = float("-inf")  # a position where the target puts no mass on the map at all
    loss = pruned_distill_loss(name, d, t, KEEP, _mask(), 10, beta=beta)
    loss.backward()
    assert loss.item() >= 0.0 and math.isfinite(loss.item())
    assert torch.isfinite(d.grad).all()


@pytest.mark.parametrize("name,beta", CASES + [("acceptance", 0.5)])
def test_exactly_zero_when_the_draft_is_the_target_on_its_support(name, beta):
    """A target with no mass off the map, and a draft equal to it there: every loss is exactly 0."""
    t = torch.full((2, 6, V), float("-inf"))
    t[..., KEEP] = _logits(5, (2, 6, len(KEEP)))
    d = t[..., KEEP].clone()
    assert pruned_distill_loss(name, d, t, KEEP, _mask(), 10, beta=beta).item() == 0.0
    assert pruned_distill_loss(name, d, t, KEEP, _mask(), 10, beta=beta, temperature=0.6).item() == 0.0


def test_minima_when_the_target_has_mass_off_the_map():
    """At q = p renormalised over the map: FKL is its minimum 0 (up to float32 rounding of the renormalisation),
    RKL its minimum −log(1 − p_off), TVD p_off (the rejection rate no pruned draft can avoid); moving q away raises
    FKL and RKL."""
    t, m = _logits(6), torch.ones(2, 6)
    p = t.softmax(-1)
    p_off = 1.0 - p[..., KEEP].sum(-1)
    best = t[..., KEEP].clone()  # softmax over the map = p renormalised
    n = int(m.sum())
    assert pruned_distill_loss("fkl", best, t, KEEP, m, n).item() == pytest.approx(0.0, abs=1e-6)
    rkl_min = (-torch.log1p(-p_off)).sum() / n
    assert pruned_distill_loss("rkl", best, t, KEEP, m, n).item() == pytest.approx(rkl_min.item(), rel=1e-5)
    assert pruned_distill_loss("tvd", best, t, KEEP, m, n).item() == pytest.approx((p_off.sum() / n).item(), rel=1e-5)
    worse = best + 0.5 * _logits(7, best.shape, scale=1.0)
    for name in ("fkl", "rkl"):
        assert pruned_distill_loss(name, worse, t, KEEP, m, n) > pruned_distill_loss(name, best, t, KEEP, m, n)
    for name in ("tvd", "rkl", "jsd"):  # off-map mass makes these > 0 whatever the draft
        assert pruned_distill_loss(name, best, t, KEEP, m, n).item() > 0.0


def test_cross_entropy_skips_labels_outside_the_map():
    d = _logits(8, (1, 3, len(KEEP)))
    labels = torch.tensor([[2, 4, 39]])  # 4 is not kept
    m = torch.ones(1, 3)
    ce = pruned_cross_entropy(d, labels, KEEP, m, 3)
    logp = d.log_softmax(-1)
    expected = -(logp[0, 0, 1] + logp[0, 2, 9]) / 3
    assert ce.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize("name,beta", CASES)
def test_cached_form(name, beta):
    """With every id cached (k = V) the cached pruned loss is the online one; with a full map it is the cached
    loss; it is exactly 0 for a draft equal to a target with no mass off the map; never negative at k < V."""
    d, t, m = _logits(9, (2, 6, len(KEEP))), _logits(10), _mask()
    top, ids, tail = topk_buckets(t, V)
    log_p = torch.cat([top, tail.unsqueeze(-1)], -1)
    cached = pruned_cached_distill_loss(name, d, log_p, ids, KEEP, V, m, 10, beta=beta)
    online = pruned_distill_loss(name, d, t, KEEP, m, 10, beta=beta)
    assert cached.item() == pytest.approx(online.item(), rel=1e-4, abs=1e-6)

    dfull = _logits(11)
    top, ids, tail = topk_buckets(t, 8)
    log_p = torch.cat([top, tail.unsqueeze(-1)], -1)
    a = pruned_cached_distill_loss(name, dfull, log_p, ids, torch.arange(V), V, m, 10, beta=beta)
    b = cached_distill_loss(name, dfull, log_p, ids, m, 10, beta=beta)
    assert a.item() == pytest.approx(b.item(), rel=1e-5, abs=1e-6)

    dk = d.clone().requires_grad_(True)
    loss = pruned_cached_distill_loss(name, dk, log_p, ids, KEEP, V, m, 10, beta=beta, ce_weight=0.2,
                                      labels=torch.zeros(2, 6, dtype=torch.long))
    loss.backward()
    assert loss.item() >= 0.0 and torch.isfinite(dk.grad).all()

    tz = torch.full((2, 6, V), float("-inf"))
    tz[..., KEEP] = t[..., KEEP]
    top, ids, tail = topk_buckets(tz, 6)
    log_p = torch.cat([top, tail.unsqueeze(-1)], -1)
    assert pruned_cached_distill_loss(name, tz[..., KEEP].clone(), log_p, ids, KEEP, V, m, 10,
                                      beta=beta).item() == pytest.approx(0.0, abs=1e-6)
