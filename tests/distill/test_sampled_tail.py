"""Sampled tail ids in the logit cache (data.logit_cache_tail_samples): the sparse target p' is a distribution,
the forward KL against it is exact (>= 0, 0 at q = p', the full FKL when k = V) and its gradient is unbiased for
the full-vocabulary FKL's, which the k + 1 buckets' gradient is not; cache-logits stores the draws reproducibly
and train refuses them for losses they do not serve."""
import math

import pytest
import torch

from distill.cache_logits import build_cache
from distill.logit_cache import LogitCache, read_manifest, sample_tail
from distill.losses import (LOG_FLOOR, cached_distill_loss, cached_divergence, fkl, pruned_sampled_tail_fkl,
                            sampled_tail_fkl, sampled_tail_target, topk_buckets)
from distill.config import SetupError
from distill.recipe import train
from distill_helpers import compose, overrides


def _entry(V=40, k=4, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, generator=g) * scale
    top, ids, tail = topk_buckets(logits[None], k)
    return logits, torch.cat([top, tail[:, None]], -1), ids


def test_sparse_target_is_a_distribution_with_merged_duplicates():
    _, lp, ids = _entry()
    tail_ids = torch.tensor([[9, 9, 12, 9]])
    log_w, support = sampled_tail_target(lp, ids, tail_ids)
    w = log_w.exp()
    assert torch.allclose(w.sum(-1), torch.ones(1), atol=1e-6)
    p_tail = lp[0, -1].exp()
    assert torch.allclose(w[0, 4:], torch.stack([3 / 4 * p_tail, 0 * p_tail, 1 / 4 * p_tail, 0 * p_tail]), atol=1e-7)
    assert torch.equal(support[0], torch.cat([ids[0], tail_ids[0]]))


def test_draw_counts_match_the_pairwise_definition():
    """Counts and first occurrences by sorting equal, on random rows with many repeats, the O(s^2) definition."""
    from distill.losses import _draw_counts

    g = torch.Generator().manual_seed(0)
    for s in (1, 4, 32, 128):
        draws = torch.randint(0, 20, (3, 5, s), generator=g)
        same = draws.unsqueeze(-1) == draws.unsqueeze(-2)
        count, first = _draw_counts(draws)
        assert torch.equal(count, same.sum(-1).float())
        assert torch.equal(first, ~same.tril(-1).any(-1))


def test_exact_zero_at_q_equal_p_prime_and_never_negative():
    _, lp, ids = _entry()
    tail_ids = torch.tensor([[9, 9, 12, 30]])
    log_w, support = sampled_tail_target(lp, ids, tail_ids)
    draft = torch.full((1, 40), float("-inf"))
    live = log_w > LOG_FLOOR  # a repeated draw's weight-0 slot must not overwrite its first occurrence
    draft[0, support[live]] = log_w[live]
    mask = torch.ones(1)
    assert float(sampled_tail_fkl(draft, lp, ids, tail_ids, mask, 1)) < 1e-6
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        d = torch.randn(1, 40, generator=g) * 3
        assert float(sampled_tail_fkl(d, lp, ids, tail_ids, mask, 1)) >= 0.0


def test_full_k_equals_the_full_vocabulary_fkl():
    logits, lp, ids = _entry(V=40, k=40)
    tail_ids = sample_tail(logits[None], ids, 8)  # no tail mass: draws carry weight 0
    d = torch.randn(1, 40)
    got = sampled_tail_fkl(d, lp, ids, tail_ids, torch.ones(1), 1)
    want = fkl(d[None], logits[None, None], torch.ones(1, 1), 1)
    assert torch.allclose(got, want, atol=1e-4)


def test_gradient_is_unbiased_for_the_full_fkl_and_the_buckets_are_not():
    V, k, s, R = 40, 4, 4, 20000
    logits, lp, ids = _entry(V, k, scale=1.0)  # a flat target: most mass in the tail
    z = torch.randn(V, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
    want = torch.autograd.grad(fkl(z[None, None], logits[None, None], torch.ones(1, 1), 1), z)[0]
    tail_ids = sample_tail(logits.expand(R, V), ids.expand(R, k), s, generator=torch.Generator().manual_seed(4))
    loss = sampled_tail_fkl(z.expand(R, V), lp.expand(R, k + 1), ids.expand(R, k), tail_ids, torch.ones(R), R)
    got = torch.autograd.grad(loss, z)[0]
    buckets = torch.autograd.grad(cached_divergence("fkl", z[None], lp, ids, torch.ones(1), 1), z)[0]
    assert (got - want).abs().max() < 3e-3
    assert (buckets - want).abs().max() > 1e-2  # the bucket loss spreads the tail like q, not like p


def test_sample_tail_never_draws_a_top_k_id_and_follows_p():
    logits, _, ids = _entry(V=40, k=4, scale=1.0)
    draws = sample_tail(logits.expand(5000, 40), ids.expand(5000, 4), 8, generator=torch.Generator().manual_seed(0))
    assert not torch.isin(draws, ids).any()
    p = torch.softmax(logits, -1).scatter(-1, ids[0], 0.0)
    freq = torch.bincount(draws.flatten(), minlength=40).float() / draws.numel()
    assert (freq - p / p.sum()).abs().max() < 0.01


def test_pruned_form_equals_the_full_form_with_every_id_kept_and_is_exact():
    _, lp, ids = _entry()
    tail_ids = torch.tensor([[9, 9, 12, 30]])
    d, one = torch.randn(1, 40, generator=torch.Generator().manual_seed(5)), torch.ones(1)
    every = torch.arange(40)
    assert torch.allclose(pruned_sampled_tail_fkl(d, lp, ids, tail_ids, every, one, 1),
                          sampled_tail_fkl(d, lp, ids, tail_ids, one, 1), atol=1e-5)
    vmap = torch.tensor(sorted(set(range(0, 40, 2)) | {int(ids[0, 0])}))  # half the ids, the top one kept
    log_w, support = sampled_tail_target(lp, ids, tail_ids)
    live = (log_w > LOG_FLOOR) & torch.isin(support, vmap)
    at_target = torch.full((1, 40), float("-inf"))
    at_target[0, support[live]] = log_w[live]  # q = w / W on the kept ids, -inf elsewhere
    assert float(pruned_sampled_tail_fkl(at_target, lp, ids, tail_ids, vmap, one, 1)) < 1e-5
    off = torch.full((1, 40), float("-inf")).index_fill(-1, vmap, 0.0)
    assert float(pruned_sampled_tail_fkl(off, lp, ids, tail_ids, vmap, one, 1)) > 0.0


def test_pruned_gradient_is_unbiased_for_the_weighted_pruned_fkl():
    V, k, s, R = 40, 4, 4, 20000
    logits, lp, ids = _entry(V, k, scale=1.0)
    vmap = torch.arange(0, V, 2)
    off_map = torch.ones(V, dtype=torch.bool).index_fill(0, vmap, False)
    z = torch.randn(V, generator=torch.Generator().manual_seed(3)).masked_fill(off_map, float("-inf"))
    z.requires_grad_(True)
    p = torch.softmax(logits, -1)
    p_kept = p.masked_fill(off_map, 0.0)
    q = torch.softmax(z.detach(), -1)
    want = p_kept.sum() * q - p_kept  # ∇ of P_kept·KL(p̃‖q) with respect to the logits
    tail_ids = sample_tail(logits.expand(R, V), ids.expand(R, k), s, generator=torch.Generator().manual_seed(4))
    loss = pruned_sampled_tail_fkl(z.expand(R, V), lp.expand(R, k + 1), ids.expand(R, k), tail_ids, vmap,
                                   torch.ones(R), R)
    got = torch.autograd.grad(loss, z)[0]
    assert (got[vmap] - want[vmap]).abs().max() < 3e-3
    assert (got[off_map] == 0).all()


def test_only_fkl_takes_tail_ids():
    _, lp, ids = _entry()
    with pytest.raises(ValueError, match="loss=fkl only"):
        cached_distill_loss("jsd", torch.randn(1, 40), lp, ids, torch.ones(1), 1, tail_ids=torch.tensor([[9, 12]]))


def test_cache_stores_draws_reproducibly_and_train_refuses_other_losses(pair, tmp_path):
    ov = lambda out, cache, *extra: overrides(pair, out, f"data.logit_cache={cache}", "data.logit_cache_k=4",  # noqa: E731
                                              "data.logit_cache_shard_size=16", "loss=fkl", *extra)
    a, b = tmp_path / "a", tmp_path / "b"
    build_cache(compose(ov(tmp_path / "r", a, "data.logit_cache_tail_samples=6")), log=lambda *_: None)
    build_cache(compose(ov(tmp_path / "r", b, "data.logit_cache_tail_samples=6")), log=lambda *_: None)
    assert read_manifest(a)["tail_samples"] == 6
    ca, cb = LogitCache(a), LogitCache(b)
    lp, ids, tail = ca.buckets([0, 1, 2])
    assert tail.shape == (ids.shape[0], 6) and not (tail[:, :, None] == ids[:, None, :]).any()
    assert torch.equal(tail, cb.buckets([0, 1, 2])[2])  # seeded per shard: the same draws
    with pytest.raises(SetupError, match="loss=fkl only"):
        train(compose(ov(tmp_path / "jsd", a, "data.target_logits=cached", "loss=jsd", "train.max_steps=1",
                         "data.logit_cache_tail_samples=null")),
              log=lambda *_: None)
    with pytest.raises(SetupError, match=r"(?s)data.logit_cache_tail_samples.*data.logit_cache_tail_samples=null "
                                         "takes the cache's own value"):  # config 0 vs cache 6: named, with the fix
        train(compose(ov(tmp_path / "zero", a, "data.target_logits=cached", "train.max_steps=1",
                         "data.logit_cache_tail_samples=0")), log=lambda *_: None)
    out = train(compose(ov(tmp_path / "ok", a, "data.target_logits=cached", "train.max_steps=2",
                           "data.logit_cache_tail_samples=null")), log=lambda *_: None)
    assert out["steps"] == 2
    pruned = train(compose(ov(tmp_path / "pruned", a, "data.target_logits=cached", "train.max_steps=2",
                              "data.logit_cache_tail_samples=null", f"draft.vocab.keep={pair['vocab'] // 2}")),
                   log=lambda *_: None)
    assert pruned["steps"] == 2 and math.isfinite(pruned["final_loss"])


def test_cache_logits_refuses_bad_builds_before_writing_and_damaged_caches_clearly(pair, tmp_path):
    import json

    ov = lambda cache, *extra: overrides(pair, tmp_path / "r", f"data.logit_cache={cache}",  # noqa: E731
                                         "data.logit_cache_shard_size=16", "loss=fkl", *extra)
    big = tmp_path / "big"
    with pytest.raises(SetupError, match="larger than the vocabulary"):
        build_cache(compose(ov(big, f"data.logit_cache_k={pair['vocab'] + 1}")), log=lambda *_: None)
    assert not (big / "manifest.json").exists()  # nothing written: the same folder takes a valid k afterwards
    with pytest.raises(SetupError, match="loss=fkl only"):
        build_cache(compose(ov(big, "data.logit_cache_tail_samples=2", "loss=jsd")), log=lambda *_: None)
    with pytest.raises(SetupError, match="fp16 needs a CUDA GPU"):
        build_cache(compose(ov(big, "train.mixed_precision=fp16", "train.cpu=true")), log=lambda *_: None)
    # an interrupted build resumes only with the seed its draws came from
    c = tmp_path / "c"
    build_cache(compose(ov(c, "data.logit_cache_k=4", "data.logit_cache_tail_samples=2")), log=lambda *_: None)
    m = json.loads((c / "manifest.json").read_text())
    (c / "manifest.json").write_text(json.dumps({**m, "complete": False}))
    with pytest.raises(SetupError, match="train.seed"):
        build_cache(compose(ov(c, "data.logit_cache_k=4", "data.logit_cache_tail_samples=2", "train.seed=5")),
                    log=lambda *_: None)
    # and the target's precision (the rest would be scored in another dtype than the shards already written)
    with pytest.raises(SetupError, match=r"started with target_dtype='None' \(target.dtype\)"):
        build_cache(compose(ov(c, "data.logit_cache_k=4", "data.logit_cache_tail_samples=2", "++target.dtype=bf16")),
                    log=lambda *_: None)
    (c / "manifest.json").write_text('{"format": 1, "k"')  # a damaged manifest is named, not a traceback
    with pytest.raises(SetupError, match="not valid JSON"):
        LogitCache(c)
