"""loss=acceptance: expected rejected draft slots over windows of γ positions (distill.losses.acceptance).
Invariants (0 at equality, never negative, equals TVD for γ = 1), a brute-force reference for the windowing at masks
and ragged ends, and that a draft closer to the target scores lower."""
import pytest
import torch

from distill.losses import acceptance, distill_loss, tvd


def _logits(seed, shape=(3, 7, 11), scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _ragged_mask():
    """Prompt then completion then padding, with different completion lengths (one of 1 token, one with a gap)."""
    m = torch.zeros(3, 7, dtype=torch.long)
    m[0, 2:7] = 1      # completion runs to the end of the row
    m[1, 3:4] = 1      # a single completion token
    m[2, 1:3] = 1      # two runs: windows must stop at the gap
    m[2, 4:6] = 1
    return m


def brute_force(draft_logits, target_logits, mask, n_tokens, gamma):
    """Σ over masked s of Σ_{j < L_s} (1 − Π_{i≤j} α_{s+i}), L_s = masked run length from s capped at γ."""
    p, q = target_logits.double().softmax(-1), draft_logits.double().softmax(-1)
    alpha = torch.minimum(p, q).sum(-1)
    total = 0.0
    B, T = mask.shape
    for b in range(B):
        for s in range(T):
            if not mask[b, s]:
                continue
            prod = 1.0
            for j in range(gamma):
                t = s + j
                if t >= T or not mask[b, t]:
                    break
                prod *= float(alpha[b, t])
                total += 1.0 - prod
    return total / n_tokens


@pytest.mark.parametrize("gamma", [1, 2, 3, 5, 9])
def test_matches_brute_force_at_masks_and_ragged_ends(gamma):
    d, t, m = _logits(0), _logits(1), _ragged_mask()
    n = int(m.sum())
    got = acceptance(d, t, m, n, gamma=gamma).item()
    assert got == pytest.approx(brute_force(d, t, m, n, gamma), rel=1e-5)
    assert distill_loss("acceptance", d, t, m, n, gamma=gamma).item() == pytest.approx(got, rel=1e-6)


def test_window_lengths_by_hand():
    """With α = 0 everywhere every slot of a window is rejected, so the loss counts window slots: a run of r masked
    positions has windows of min(γ, r), min(γ, r − 1), ..., 1 slots."""
    V = 4
    t = torch.zeros(2, 6, V)
    t[..., 0] = 50.0  # target certain of id 0
    d = torch.zeros(2, 6, V)
    d[..., 1] = 50.0  # draft certain of id 1: α = 0
    m = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 0, 1, 0, 0]])
    # row 0: run of 5 -> windows 3,3,3,2,1 = 12; row 1: runs of 2 and 1 -> 2,1 and 1 = 4
    assert acceptance(d, t, m, 1, gamma=3).item() == pytest.approx(16.0, abs=1e-4)


def test_zero_for_identical_and_never_negative():
    x, m = _logits(0), _ragged_mask()
    assert acceptance(x, x.clone(), m, int(m.sum()), gamma=4).item() == 0.0
    for seed in range(5):
        d, t = _logits(2 * seed, scale=4.0), _logits(2 * seed + 1, scale=4.0)
        value = acceptance(d, t, m, int(m.sum()), gamma=4).item()
        assert 0.0 < value <= 4.0


def test_gamma_one_is_tvd_and_longer_windows_cost_more():
    d, t, m = _logits(0), _logits(1), _ragged_mask()
    n = int(m.sum())
    assert acceptance(d, t, m, n, gamma=1).item() == pytest.approx(tvd(d, t, m, n).item(), rel=1e-6)
    values = [acceptance(d, t, m, n, gamma=g).item() for g in (1, 2, 4, 8)]
    assert values == sorted(values) and values[0] < values[-1]


def test_closer_draft_scores_lower_and_a_gradient_step_helps():
    t, m = _logits(1), _ragged_mask()
    noise = _logits(5)
    n = int(m.sum())
    values = [acceptance(t + lam * noise, t, m, n, gamma=4).item() for lam in (0.1, 0.5, 1.0, 2.0)]
    assert values == sorted(values) and values[0] < 0.5 * values[-1]

    d = (t + noise).clone().requires_grad_(True)
    before = acceptance(d, t, m, n, gamma=4)
    before.backward()
    assert d.grad[m == 0].abs().max() == 0  # masked positions get no gradient
    with torch.no_grad():
        stepped = d - 0.5 * d.grad
    assert acceptance(stepped, t, m, n, gamma=4).item() < before.item()
    assert tvd(stepped, t, m, n).item() < tvd(d.detach(), t, m, n).item()


def test_a_position_counts_more_when_the_drafts_before_it_are_accepted():
    """Fixing the draft at position 1 gains more when position 0 is accepted (its draft is reached more often);
    TVD gains the same either way."""
    V = 5
    t = _logits(3, (1, 3, V))
    d = _logits(4, (1, 3, V))
    m = torch.ones(1, 3)
    good0, bad0 = d.clone(), d.clone()
    good0[0, 0] = t[0, 0]            # α_0 = 1
    bad0[0, 0] = -10 * t[0, 0]       # α_0 near 0

    def gain(base, loss):
        fixed = base.clone()
        fixed[0, 1] = t[0, 1]
        return loss(base, t, m, 3).item() - loss(fixed, t, m, 3).item()

    def acc(*a):
        return acceptance(*a, gamma=3)

    assert gain(good0, acc) > 1.5 * gain(bad0, acc) > 0
    assert gain(good0, tvd) == pytest.approx(gain(bad0, tvd), rel=1e-5)


def test_masked_garbage_is_ignored_and_accumulation_is_exact():
    d, t, m = _logits(0), _logits(1), _ragged_mask()
    d2, t2 = d.clone(), t.clone()
    d2[m == 0] = 1e4
    t2[m == 0] = float("nan")
    n = int(m.sum())
    assert acceptance(d2, t2, m, n, gamma=3).item() == pytest.approx(acceptance(d, t, m, n, gamma=3).item(), rel=1e-6)
    # Two micro-batches with the window's token count sum to the full batch's loss.
    parts = acceptance(d[:1], t[:1], m[:1], n, gamma=3) + acceptance(d[1:], t[1:], m[1:], n, gamma=3)
    assert parts.item() == pytest.approx(acceptance(d, t, m, n, gamma=3).item(), rel=1e-6)


@pytest.mark.parametrize("gamma", [0, -1, 1.5, True])
def test_bad_gamma_is_an_error(gamma):
    d, t, m = _logits(0), _logits(1), _ragged_mask()
    with pytest.raises(ValueError, match="gamma"):
        acceptance(d, t, m, 1, gamma=gamma)


# -------------------------------------------------------------------------------- wired into the recipe
def test_recipe_trains_with_loss_acceptance_and_accumulates_exactly(pair, tmp_path):
    """loss=acceptance runs in the recipe on the (B, T) layout; batch 4 x accum 1 == batch 2 x accum 2, and the
    loss goes down."""
    import json

    from distill.recipe import train
    from distill_helpers import compose, overrides

    common = ("loss=acceptance", "loss.gamma=3", "train.max_steps=6", "optim.lr=1e-2", "train.save_every=0")
    train(compose(overrides(pair, tmp_path / "a", *common, "train.batch_size=4", "train.grad_accum=1")),
          log=lambda *_: None)
    train(compose(overrides(pair, tmp_path / "b", *common, "train.batch_size=2", "train.grad_accum=2")),
          log=lambda *_: None)

    def losses(out):
        return {m["step"]: m["train/loss"] for m in map(json.loads, open(out / "metrics.jsonl")) if "train/loss" in m}

    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert la.keys() == lb.keys() and len(la) == 6
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=1e-5)
    assert 0 < la[6] < la[1] <= 3.0


@pytest.mark.parametrize("gamma", ["0", "2.5"])
def test_recipe_rejects_a_bad_gamma_before_loading(pair, tmp_path, gamma):
    from distill.config import SetupError
    from distill.recipe import train
    from distill_helpers import compose, overrides

    with pytest.raises(SetupError, match="loss.gamma"):
        train(compose(overrides(pair, tmp_path / "run", "loss=acceptance", f"loss.gamma={gamma}")),
              log=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_recipe_acceptance_on_the_column_span_equals_the_full_sequence_layout(pair):
    """The recipe runs the lm_heads of loss=acceptance only on the column span holding completion tokens; the loss
    and its gradient equal those of distill_loss on the full (B, T) logits, gaps inside a row included."""
    import contextlib
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from distill.recipe import loss_on_batch

    target = AutoModelForCausalLM.from_pretrained(str(pair["target"]), torch_dtype=torch.float64).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(pair["draft"]), torch_dtype=torch.float64)
    vocab = target.config.vocab_size
    ids = torch.randint(3, vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(3, 9, dtype=torch.long)
    mask[0, 2:4] = 1
    mask[1, 3:4] = 1
    mask[2, 3:4] = 1  # row 2 has a gap at columns 4-6 where no row has a completion token: keeping only columns
    mask[2, 7:9] = 1  # with a completion token would join its columns 3 and 7 into one window
    labels = torch.roll(ids, -1, dims=1)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask, "labels": labels}
    cfg = SimpleNamespace(loss=SimpleNamespace(name="acceptance", gamma=3, beta=0.5, temperature=1.0, ce_weight=0.0))
    acc = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    run = SimpleNamespace(cfg=cfg, accelerator=acc, target=target, draft=draft, vocab=vocab, logit_cache=None,
                          logits_to_keep={}, intersection=None)
    n = int(mask.sum())
    got = loss_on_batch(run, batch, n)
    (g_got,) = torch.autograd.grad(got, draft.lm_head.weight)
    with torch.no_grad():
        t_full = target(input_ids=ids).logits
    want = distill_loss("acceptance", draft(input_ids=ids).logits, t_full, mask, n, gamma=3)
    (g_want,) = torch.autograd.grad(want, draft.lm_head.weight)
    assert got.item() == pytest.approx(want.item(), rel=1e-10, abs=1e-12) and got.item() > 0
    assert torch.allclose(g_got, g_want, rtol=1e-8, atol=1e-12)


def test_acceptance_has_no_cached_form():
    """The logit cache holds top-k + tail per position: loss=acceptance with it is refused (config and loss)."""
    from distill.losses import cached_divergence

    with pytest.raises(ValueError, match="no cached"):
        cached_divergence("acceptance", torch.zeros(1, 2, 5), torch.full((1, 2, 3), -1.0986),
                          torch.zeros(1, 2, 2, dtype=torch.long), torch.ones(1, 2), 2)


def test_cached_target_logits_with_loss_acceptance_is_refused_before_loading(pair, tmp_path):
    from distill.checks import validate
    from distill.config import SetupError
    from distill_helpers import compose, overrides

    cfg = compose(overrides(pair, tmp_path / "run", "loss=acceptance", "data.target_logits=cached",
                            f"data.logit_cache={tmp_path / 'cache'}"))
    with pytest.raises(SetupError, match="loss=acceptance.*data.target_logits=online"):
        validate(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["fkl", "acceptance"])
def test_ce_labels_target_is_the_cross_entropy_to_the_target_s_greedy_choice(pair, name):
    """loss.ce_labels=target (a top-1 agreement term for greedy decoding): with ce_weight=1 the recipe's loss is
    exactly the cross-entropy of the draft against the target's argmax at every completion position, not against
    the data's next tokens (which differ from it here: random ids)."""
    import contextlib
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from distill.losses import cross_entropy
    from distill.recipe import loss_on_batch

    target = AutoModelForCausalLM.from_pretrained(str(pair["target"]), torch_dtype=torch.float64).eval()
    draft = AutoModelForCausalLM.from_pretrained(str(pair["draft"]), torch_dtype=torch.float64)
    vocab = target.config.vocab_size
    ids = torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(2, 8, dtype=torch.long)
    mask[:, 3:7] = 1
    labels = torch.roll(ids, -1, dims=1)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask, "labels": labels}
    acc = SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext)
    n = int(mask.sum())
    with torch.no_grad():
        greedy = target(input_ids=ids).logits[..., :vocab].argmax(-1)
    assert not torch.equal(greedy[mask.bool()], labels[mask.bool()])
    got = {}
    for which in ("data", "target"):
        cfg = OmegaConf.create({"loss": dict(name=name, gamma=3, beta=0.5, temperature=1.0, ce_weight=1.0,
                                             ce_labels=which, fused=True)})
        run = SimpleNamespace(cfg=cfg, accelerator=acc, target=target, draft=draft, vocab=vocab, logit_cache=None,
                              logits_to_keep={}, intersection=None)
        got[which] = loss_on_batch(run, batch, n).item()
    draft_logits = draft(input_ids=ids).logits[..., :vocab]
    assert got["target"] == pytest.approx(cross_entropy(draft_logits, greedy, mask, n).item(), rel=1e-10)
    assert got["data"] == pytest.approx(cross_entropy(draft_logits, labels, mask, n).item(), rel=1e-10)


def test_target_top1_of_a_cached_row_is_its_most_probable_cached_id_and_weights_on_policy_ce():
    """The cache keeps the top k ids in any order and a tail bucket last: the label is the id of the largest of the
    first k log-probs, never the tail. With ce_labels=target the CE weight applies to on-policy batches too (the
    labels are the target's, not the draft's own samples); with data labels it stays 0 there."""
    from types import SimpleNamespace

    from distill.recipe import ce_weight, target_top1

    log_p = torch.log(torch.tensor([[0.1, 0.3, 0.2, 0.4], [0.5, 0.1, 0.2, 0.2]]))  # (N, k+1): last = tail bucket
    ids = torch.tensor([[7, 3, 9], [4, 8, 2]])
    assert target_top1("cached", (log_p, ids, None), vocab=10).tolist() == [3, 4]
    logits = torch.tensor([[0.0, 2.0, 1.0, 9.0]])  # the 4th id is lm_head padding past the shared vocabulary
    assert target_top1("logits", logits, vocab=3).tolist() == [1]
    for labels, on_policy in (("data", 0.0), ("target", 0.3)):
        cfg = SimpleNamespace(loss=SimpleNamespace(ce_weight=0.3, ce_labels=labels))
        assert ce_weight(cfg, on_policy=True) == on_policy and ce_weight(cfg, on_policy=False) == 0.3
