"""The fused divergences (closed-form gradient, distill.losses.FusedDivergence) against finite differences
(float64 gradcheck), against the autograd reference losses (float32, every loss, β, temperature, masked rows), and
against a textbook float64 oracle; the invariants (0 for identical inputs, never negative) and the recipe's step."""
import json

import pytest
import torch

from distill.losses import FusedDivergence, distill_loss, fused_divergence

NAMES = ["fkl", "rkl", "jsd", "tvd"]
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
CASES = [(n, b) for n in NAMES for b in (BETAS if n == "jsd" else [0.5])]


def _logits(seed, shape, scale=3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _mask(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(rows, generator=g) > 0.25).long()
    m[0] = 0  # at least one masked position
    return m


def _loss_and_grad(name, d, t, mask, n_tokens, beta, temperature, fused):
    x = d.clone().requires_grad_(True)
    loss = distill_loss(name, x, t, mask, n_tokens, beta=beta, temperature=temperature, fused=fused)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name,beta", CASES)
def test_gradcheck_float64(name, beta, temperature):
    """The closed-form backward equals finite differences of the forward, masked rows included."""
    d, t = _logits(0, (6, 7), dtype=torch.float64), _logits(1, (6, 7), dtype=torch.float64)
    keep = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool).unsqueeze(1)
    d.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: FusedDivergence.apply(x, t, keep, name, beta, temperature), (d,))


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name,beta", CASES)
def test_equals_autograd_reference_float32(name, beta, temperature):
    """(64, 512) float32: value and gradient of the fused loss = the autograd reference; masked rows hold NaN."""
    d, t = _logits(2, (1, 64, 512)), _logits(3, (1, 64, 512))
    mask = _mask(64).unsqueeze(0)
    d[0, 0], t[0, 0] = float("nan"), float("-inf")  # garbage at a masked position reaches neither value nor grad
    n_tokens = int(mask.sum()) + 7  # a larger accumulation window: the division must be the same
    ref, ref_grad = _loss_and_grad(name, d, t, mask, n_tokens, beta, temperature, fused=False)
    val, grad = _loss_and_grad(name, d, t, mask, n_tokens, beta, temperature, fused=True)
    torch.testing.assert_close(val, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-9)
    assert torch.isfinite(grad).all() and grad[0, 0].abs().max() == 0
    assert grad[mask == 0].abs().max() == 0


def _oracle(name, d, t, beta, temperature):
    """Per-position divergence from the textbook definitions, float64, no shared code with distill.losses."""
    p, q = torch.softmax(t / temperature, -1), torch.softmax(d / temperature, -1)
    kl = lambda a, b: (a * (a.log() - b.log())).sum(-1)  # noqa: E731
    if name == "fkl" or (name == "jsd" and beta == 0):
        return kl(p, q)
    if name == "rkl" or (name == "jsd" and beta == 1):
        return kl(q, p)
    if name == "jsd":
        m = beta * p + (1 - beta) * q
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    return 0.5 * (p - q).abs().sum(-1)


@pytest.mark.parametrize("name,beta", CASES)
def test_equals_textbook_oracle(name, beta):
    d, t = _logits(4, (16, 33), dtype=torch.float64), _logits(5, (16, 33), dtype=torch.float64)
    x = d.clone().requires_grad_(True)
    _oracle(name, x, t, beta, 2.0).sum().backward()
    y = d.clone().requires_grad_(True)
    per = FusedDivergence.apply(y, t, torch.ones(16, 1, dtype=torch.bool), name, beta, 2.0)
    per.sum().backward()
    torch.testing.assert_close(per, _oracle(name, d, t, beta, 2.0), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name,beta", CASES)
def test_identical_inputs_give_exactly_zero_and_no_gradient(name, beta):
    for dtype in (torch.float32, torch.bfloat16):
        d = _logits(6, (2, 9, 300), dtype=dtype)
        mask = torch.ones(2, 9)
        x = d.clone().requires_grad_(True)
        loss = fused_divergence(name, x, d.clone(), mask, 18, beta=beta)
        assert loss.item() == 0.0
        loss.backward()
        assert x.grad.float().abs().max() < 1e-6


@pytest.mark.parametrize("name,beta", CASES)
def test_never_negative_and_matches_reference_on_nearly_equal_and_masked_vocab(name, beta):
    """Nearly equal logits make some log p == log q exactly in float32: JSD's override log m = log p there must
    not cut the reference's gradient (it did: 20% of the largest gradient off), nor the fused one's."""
    d = _logits(7, (1, 32, 200))
    t = d + 1e-4 * _logits(8, (1, 32, 200))
    t[..., -5:] = float("-inf")  # the target's vocabulary mask: ids the target never emits
    d[..., -3:] = float("-inf")  # and the draft's
    mask = torch.ones(1, 32)
    per = FusedDivergence.apply(d[0], t[0], torch.ones(32, 1, dtype=torch.bool), name, beta, 1.0)
    assert (per >= 0).all() and torch.isfinite(per).all()
    ref, ref_grad = _loss_and_grad(name, d, t, mask, 32, beta, 1.0, fused=False)
    val, grad = _loss_and_grad(name, d, t, mask, 32, beta, 1.0, fused=True)
    torch.testing.assert_close(val, ref, rtol=1e-3, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=1e-7)
    assert grad[..., -3:].abs().max() == 0  # no gradient into the draft's masked ids


@pytest.mark.parametrize("name,beta", CASES)
def test_gradient_accumulation_is_exact(name, beta):
    """Two micro-batches with the window's token count give the gradient of the whole batch."""
    d, t = _logits(9, (4, 10, 50)), _logits(10, (4, 10, 50))
    mask = torch.ones(4, 10)
    mask[0, :3] = 0
    n = int(mask.sum())
    _, whole = _loss_and_grad(name, d, t, mask, n, beta, 1.0, fused=True)
    _, first = _loss_and_grad(name, d[:2], t[:2], mask[:2], n, beta, 1.0, fused=True)
    _, second = _loss_and_grad(name, d[2:], t[2:], mask[2:], n, beta, 1.0, fused=True)
    torch.testing.assert_close(torch.cat([first, second]), whole)


@pytest.mark.parametrize("name,beta", [("jsd", 0.5), ("fkl", 0.5)])
def test_bf16_logits_get_a_bf16_gradient_close_to_the_reference(name, beta):
    d, t = _logits(11, (1, 32, 256), dtype=torch.bfloat16), _logits(12, (1, 32, 256), dtype=torch.bfloat16)
    mask = torch.ones(1, 32)
    ref, ref_grad = _loss_and_grad(name, d, t, mask, 32, beta, 1.0, fused=False)
    val, grad = _loss_and_grad(name, d, t, mask, 32, beta, 1.0, fused=True)
    assert grad.dtype == torch.bfloat16 and val.dtype == torch.float32
    torch.testing.assert_close(val, ref)
    torch.testing.assert_close(grad, ref_grad)


def test_blocks_of_rows_give_the_same_result(monkeypatch):
    """The forward and backward run block of rows by block of rows; one row per block changes nothing."""
    import distill.losses as losses

    d, t = _logits(13, (1, 20, 64)), _logits(14, (1, 20, 64))
    mask = _mask(20).unsqueeze(0)
    val, grad = _loss_and_grad("jsd", d, t, mask, 20, 0.5, 1.0, fused=True)
    monkeypatch.setitem(losses._BLOCK_ELEMENTS, "cpu", 1)
    val1, grad1 = _loss_and_grad("jsd", d, t, mask, 20, 0.5, 1.0, fused=True)
    torch.testing.assert_close(val1, val)
    torch.testing.assert_close(grad1, grad)


def test_errors():
    d, t, m = _logits(0, (1, 3, 5)), _logits(1, (1, 3, 5)), torch.ones(1, 3)
    with pytest.raises(ValueError, match="no fused form"):
        fused_divergence("acceptance", d, t, m, 3)
    with pytest.raises(ValueError, match="requires grad"):
        fused_divergence("jsd", d, t.requires_grad_(True), m, 3)
    with pytest.raises(ValueError, match="beta"):
        fused_divergence("jsd", d, t.detach(), m, 3, beta=1.5)
    with pytest.raises(ValueError, match="same shape"):
        fused_divergence("fkl", d, t.detach()[..., :4], m, 3)
    with pytest.raises(ValueError, match="temperature"):
        fused_divergence("fkl", d, t.detach(), m, 3, temperature=0.0)


def test_recipe_steps_are_the_same_with_either_form(pair, tmp_path):
    """loss.fused=true and false train the same run (losses and weights after 4 steps)."""
    from distill.recipe import train
    from distill_helpers import compose, overrides
    from safetensors.torch import load_file

    runs = {}
    for fused in ("true", "false"):
        out = tmp_path / fused
        train(compose(overrides(pair, out, "loss=jsd", "loss.temperature=2.0", f"loss.fused={fused}")),
              log=lambda *_: None)
        losses = [m["train/loss"] for m in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in m]
        runs[fused] = losses, load_file(str(out / "step_000004" / "model.safetensors"))
    assert runs["true"][0] == pytest.approx(runs["false"][0], rel=1e-5) and len(runs["true"][0]) == 4
    for k, w in runs["true"][1].items():
        torch.testing.assert_close(w, runs["false"][1][k], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("name,beta", CASES)
def test_cached_fused_equals_autograd_reference(name, beta, temperature):
    """The cached (top-k + tail) losses with the closed-form bucket gradient: value and gradient = autograd's, for
    k < V and k = V, masked rows holding NaN, float32 and bf16 draft logits."""
    from distill.losses import cached_distill_loss, topk_buckets

    vocab = 96
    for k in (5, vocab):
        for dtype in (torch.float32, torch.bfloat16):
            d, t = _logits(15, (1, 48, vocab), dtype=dtype), _logits(16, (48, vocab))
            top, ids, tail = topk_buckets(t, k, temperature)
            cache = torch.cat([top, tail[:, None]], -1).half().unsqueeze(0)
            ids = ids.int().unsqueeze(0)
            mask = _mask(48, seed=1).unsqueeze(0)
            d[0, 0], ids[0, 0] = float("nan"), -1
            out = {}
            for fused in (False, True):
                x = d.clone().requires_grad_(True)
                loss = cached_distill_loss(name, x, cache, ids, mask, 50, beta=beta, temperature=temperature,
                                           fused=fused)
                loss.backward()
                out[fused] = loss.detach(), x.grad
            assert out[True][1].dtype == dtype and torch.isfinite(out[True][1]).all()
            torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-5, atol=1e-7)
            tol = dict(rtol=1e-4, atol=1e-9) if dtype == torch.float32 else {}  # bf16: one rounding of the result
            torch.testing.assert_close(out[True][1], out[False][1], **tol)
            assert out[True][1][mask == 0].abs().max() == 0


def test_cached_fused_with_neg_inf_draft_logits_matches_autograd():
    """-inf draft logits (a draft's vocabulary mask), also at cached ids: no NaN, the same gradient."""
    from distill.losses import cached_distill_loss, topk_buckets

    d, t = _logits(17, (1, 16, 40)), _logits(18, (16, 40))
    top, ids, tail = topk_buckets(t, 6)
    d[..., ids[0, :2]] = float("-inf")
    d[..., -4:] = float("-inf")
    cache, ids = torch.cat([top, tail[:, None]], -1).unsqueeze(0), ids.unsqueeze(0)
    grads = []
    for fused in (False, True):
        x = d.clone().requires_grad_(True)
        cached_distill_loss("fkl", x, cache, ids, torch.ones(1, 16), 16, fused=fused).backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[1]).all()
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-9)


def test_cached_recipe_steps_are_the_same_with_either_form(pair, tmp_path):
    """data.target_logits=cached trains the same run with loss.fused=true and false (k = 8 of the vocabulary)."""
    from distill.cache_logits import build_cache
    from distill.recipe import train
    from distill_helpers import compose, overrides
    from safetensors.torch import load_file

    cache = tmp_path / "cache"
    cache_ov = [f"data.logit_cache={cache}", "data.logit_cache_k=8", "loss=jsd", "loss.beta=0.9"]
    build_cache(compose(overrides(pair, tmp_path / "c", *cache_ov)), log=lambda *_: None)
    weights, losses = {}, {}
    for fused in ("true", "false"):
        out = tmp_path / fused
        summary = train(compose(overrides(pair, out, *cache_ov, "data.target_logits=cached", "train.max_steps=3",
                                          "train.save_every=3", f"loss.fused={fused}")), log=lambda *_: None)
        losses[fused] = summary["final_loss"]
        weights[fused] = load_file(str(out / "step_000003" / "model.safetensors"))
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)
    for k, w in weights["true"].items():
        torch.testing.assert_close(w, weights["false"][k], rtol=1e-4, atol=1e-6)


def test_no_loss_positions():
    """A micro-batch without completion tokens: 0 and a zero gradient of the right shape, online and cached."""
    from distill.losses import cached_distill_loss

    x = torch.zeros(1, 0, 12, requires_grad=True)
    loss = distill_loss("jsd", x, torch.zeros(1, 0, 12), torch.ones(1, 0), 0, fused=True)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (1, 0, 12)
    y = torch.zeros(1, 0, 12, requires_grad=True)
    cached = cached_distill_loss("fkl", y, torch.zeros(1, 0, 4), torch.zeros(1, 0, 3, dtype=torch.long),
                                 torch.ones(1, 0), 0, fused=True)
    cached.backward()
    assert cached.item() == 0.0 and y.grad.shape == (1, 0, 12)
