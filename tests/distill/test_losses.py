"""Invariants of the distillation losses: zero at equality, KL endpoints of JSD, TVD = expected rejection,
masking, exact gradient accumulation, finiteness under -inf / fully masked rows / bf16."""
import math

import pytest
import torch
import torch.nn.functional as F

from distill.losses import check_loss_name, cross_entropy, distill_loss, fkl, jsd, rkl, tvd

NAMES = ["fkl", "rkl", "jsd", "tvd"]


def _logits(seed, shape=(2, 5, 11), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _mask(shape=(2, 5)):
    m = torch.ones(shape, dtype=torch.long)
    m[0, :2] = 0
    m[1, -1] = 0
    return m


@pytest.mark.parametrize("name", NAMES)
def test_zero_when_draft_equals_target(name):
    x, m = _logits(0), _mask()
    assert distill_loss(name, x, x.clone(), m, int(m.sum())).item() == pytest.approx(0.0, abs=1e-6)
    assert distill_loss(name, x, x.clone(), m, int(m.sum())).item() >= 0


@pytest.mark.parametrize("name", NAMES)
def test_positive_when_different(name):
    d, t, m = _logits(0), _logits(1), _mask()
    assert distill_loss(name, d, t, m, int(m.sum())).item() > 1e-3


def test_jsd_endpoints_equal_torch_kl_div():
    d, t, m = _logits(0), _logits(1), torch.ones(2, 5)
    n = int(m.sum())
    log_q, log_p = F.log_softmax(d.float(), -1), F.log_softmax(t.float(), -1)
    # kl_div(input=log q, target=log p) = KL(p‖q)
    ref_fkl = F.kl_div(log_q, log_p, reduction="sum", log_target=True) / n
    ref_rkl = F.kl_div(log_p, log_q, reduction="sum", log_target=True) / n
    assert jsd(d, t, m, n, beta=0.0).item() == pytest.approx(ref_fkl.item(), rel=1e-5)
    assert jsd(d, t, m, n, beta=1.0).item() == pytest.approx(ref_rkl.item(), rel=1e-5)
    assert fkl(d, t, m, n).item() == pytest.approx(ref_fkl.item(), rel=1e-5)
    assert rkl(d, t, m, n).item() == pytest.approx(ref_rkl.item(), rel=1e-5)
    assert fkl(d, t, m, n).item() != pytest.approx(rkl(d, t, m, n).item(), rel=1e-3)


def test_jsd_half_is_symmetric_and_bounded():
    d, t, m = _logits(0), _logits(1), torch.ones(2, 5)
    a, b = jsd(d, t, m, 10, beta=0.5).item(), jsd(t, d, m, 10, beta=0.5).item()
    assert a == pytest.approx(b, rel=1e-5)
    assert 0 < a <= math.log(2) + 1e-6
    with pytest.raises(ValueError, match="beta"):
        jsd(d, t, m, 10, beta=1.5)


def test_tvd_is_expected_rejection():
    d, t = _logits(0, (1, 1, 7)), _logits(1, (1, 1, 7))
    p, q = t.softmax(-1)[0, 0], d.softmax(-1)[0, 0]
    # speculative sampling accepts x~q with prob min(1, p/q): rejection = 1 - Σ q·min(1, p/q) = 1 - Σ min(p, q)
    rejection = 1 - (q * torch.clamp(p / q, max=1.0)).sum()
    assert tvd(d, t, torch.ones(1, 1), 1).item() == pytest.approx(rejection.item(), rel=1e-5)
    assert tvd(d, t, torch.ones(1, 1), 1).item() == pytest.approx(0.5 * (p - q).abs().sum().item(), rel=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_masked_positions_contribute_nothing(name):
    d, t, m = _logits(0), _logits(1), _mask()
    d2, t2 = d.clone(), t.clone()
    d2[m == 0] = torch.randn_like(d2[m == 0]) * 50
    t2[m == 0] = float("nan")
    n = int(m.sum())
    assert distill_loss(name, d, t, m, n).item() == pytest.approx(distill_loss(name, d2, t2, m, n).item(), rel=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_gradient_accumulation_is_exact(name):
    """Two micro-batches divided by the window's token count give the full batch's loss and gradient."""
    t, m = _logits(1, (4, 5, 11)), torch.ones(4, 5, dtype=torch.long)
    m[0, :3] = 0
    m[3, 1:] = 0  # unequal token counts per micro-batch: a per-micro-batch mean would be wrong
    d_full = _logits(0, (4, 5, 11)).requires_grad_(True)
    full = distill_loss(name, d_full, t, m, int(m.sum()))
    full.backward()
    d_acc = d_full.detach().clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 1), slice(1, 4)):
        part = distill_loss(name, d_acc[sl], t[sl], m[sl], int(m.sum()))
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), rel=1e-6)
    torch.testing.assert_close(d_acc.grad, d_full.grad)


@pytest.mark.parametrize("name", NAMES)
def test_finite_for_fully_masked_rows_and_neg_inf_logits(name):
    d, t = _logits(0), _logits(1)
    m = torch.ones(2, 5, dtype=torch.long)
    m[1] = 0  # a fully masked row (all prompt or padding)
    d[1] = float("-inf")  # rows that are all -inf where masked must not matter
    t[0, :, 3] = float("-inf")  # a vocabulary entry masked in the target only
    d[0, :, 5] = float("-inf")  # and another one in the draft only
    d = d.requires_grad_(True)
    loss = distill_loss(name, d, t, m, int(m.sum()))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(d.grad).all()
    zero = distill_loss(name, d, t, torch.zeros(2, 5), 0)
    assert zero.item() == 0.0


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_finite_and_close(name, dtype):
    d, t, m = _logits(0, scale=8.0), _logits(1, scale=8.0), _mask()
    ref = distill_loss(name, d, t, m, int(m.sum()))
    dl = d.to(dtype).requires_grad_(True)
    low = distill_loss(name, dl, t.to(dtype), m, int(m.sum()))
    low.backward()
    assert low.dtype == torch.float32 and torch.isfinite(low) and torch.isfinite(dl.grad.float()).all()
    assert low.item() == pytest.approx(ref.item(), rel=0.1, abs=0.05)


def test_temperature_flattens_both_sides():
    d, t, m = _logits(0), _logits(1), torch.ones(2, 5)
    hot = fkl(d, t, m, 10, temperature=4.0).item()
    assert hot < fkl(d, t, m, 10).item()
    assert hot == pytest.approx(fkl(d / 4, t / 4, m, 10).item(), rel=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        fkl(d, t, m, 10, temperature=0.0)


def test_ce_mixing():
    d, t, m = _logits(0), _logits(1), _mask()
    labels = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(0))
    n = int(m.sum())
    ce = cross_entropy(d, labels, m, n)
    ref = F.cross_entropy(d[m.bool()].float(), labels[m.bool()], reduction="sum") / n
    assert ce.item() == pytest.approx(ref.item(), rel=1e-5)
    mixed = distill_loss("tvd", d, t, m, n, labels=labels, ce_weight=0.25)
    assert mixed.item() == pytest.approx(0.75 * tvd(d, t, m, n).item() + 0.25 * ref.item(), rel=1e-5)
    with pytest.raises(ValueError, match="labels"):
        distill_loss("tvd", d, t, m, n, ce_weight=0.5)


def test_bad_names_and_shapes():
    with pytest.raises(ValueError, match="unknown loss 'kld'.*fkl"):
        check_loss_name("kld")
    with pytest.raises(ValueError, match="same shape"):
        fkl(_logits(0), _logits(1, (2, 5, 12)), _mask(), 8)


BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _each_position(name, d, t, beta):
    """The divergence at every position alone (mask one position, n_tokens=1): (N,) values."""
    n = d.shape[1]
    out = []
    for i in range(n):
        m = torch.zeros(1, n)
        m[0, i] = 1
        out.append(distill_loss(name, d, t, m, 1, beta=beta))
    return torch.stack(out)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_exactly_zero_for_identical_inputs(name, beta, dtype):
    """Not approximately: 0.0 at every position for identical logits (JSD(0.5) gave -6e-8 before)."""
    x = _logits(3, shape=(1, 48, 257), scale=4.0).to(dtype)
    x[0, ::7, ::5] = float("-inf")  # vocabulary masks on both sides
    per = _each_position(name, x, x.clone(), beta)
    assert torch.all(per == 0.0), per[per != 0]
    assert distill_loss(name, x, x.clone(), torch.ones(1, 48), 48, beta=beta).item() == 0.0


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("name", NAMES)
def test_never_negative_for_random_and_nearly_equal_logits(name, beta):
    """Random pairs and pairs that differ by a few ulps (where rounding used to go below 0): every value >= 0."""
    d = _logits(4, shape=(1, 48, 257), scale=4.0).float()
    far = _logits(5, shape=(1, 48, 257), scale=4.0).float()
    near = d + torch.randn(d.shape, generator=torch.Generator().manual_seed(6)) * 1e-6
    for t in (far, near):
        per = _each_position(name, d, t, beta)
        assert torch.all(per >= 0.0), per.min()
    assert torch.all(_each_position(name, d, far, beta) > 0)
