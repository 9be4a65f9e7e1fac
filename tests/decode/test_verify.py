import torch

from decode.verify import verify

V = 8


def tvd(a, b):
    return 0.5 * (a - b).abs().sum().item()


def noise_bound(p, n, k=4.0):
    """k times the typical TVD of an n-sample histogram of p from p itself (0.5 Σ sqrt(p(1-p)/n))."""
    return k * 0.5 * float((p * (1 - p) / n).sqrt().sum())


def random_dist(seed, V=V, sharp=2.0):
    return (torch.randn(V, generator=torch.Generator().manual_seed(seed)) * sharp).softmax(-1)


def test_always_accept_when_draft_equals_target():
    p = random_dist(0)
    B, gamma = 64, 3
    q = p.expand(B, gamma, V)
    tokens = torch.multinomial(p, B * gamma, replacement=True, generator=torch.Generator().manual_seed(1)).view(B, gamma)
    n, nxt = verify(q, p.expand(B, gamma + 1, V), tokens, torch.Generator().manual_seed(2))
    assert torch.equal(n, torch.full((B,), gamma))


def test_never_accept_disjoint_support():
    p = torch.zeros(V); p[:4] = 0.25
    q = torch.zeros(V); q[4:] = 0.25
    tokens = torch.full((100, 2), 5)
    n, nxt = verify(q.expand(100, 2, V), p.expand(100, 3, V), tokens, torch.Generator().manual_seed(0))
    assert torch.equal(n, torch.zeros(100, dtype=torch.long))
    assert bool((nxt < 4).all())  # the residual is p itself here


def test_greedy_one_hot_accepts_while_argmax_matches():
    target_argmax = torch.tensor([[3, 5, 1, 7]])  # γ = 3 plus bonus
    draft_tokens = torch.tensor([[3, 5, 2]])
    p = torch.nn.functional.one_hot(target_argmax, V).float()
    q = torch.nn.functional.one_hot(draft_tokens, V).float()
    n, nxt = verify(q, p, draft_tokens, torch.Generator().manual_seed(0))
    assert n.tolist() == [2] and nxt.tolist() == [1]
    n, nxt = verify(q, p, draft_tokens, torch.Generator().manual_seed(1))
    assert n.tolist() == [2] and nxt.tolist() == [1]  # deterministic whatever the seed
    all_match = torch.tensor([[3, 5, 1]])
    n, nxt = verify(torch.nn.functional.one_hot(all_match, V).float(), p, all_match, None)
    assert n.tolist() == [3] and nxt.tolist() == [7]  # bonus = target argmax at position γ


def test_lossless_first_token_histogram():
    """≥1e5 draws: the first committed token (accepted draft or residual sample) is distributed as p."""
    N = 200_000
    for seed in range(3):
        p, q = random_dist(10 + seed), random_dist(20 + seed)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.multinomial(q, N, replacement=True, generator=g).view(N, 1)
        n, nxt = verify(q.expand(N, 1, V), p.expand(N, 2, V), tokens, g)
        first = torch.where(n > 0, tokens[:, 0], nxt)
        emp = torch.bincount(first, minlength=V).float() / N
        assert tvd(emp, p) < 0.01, (seed, emp, p)
        # Power check: the draft's own samples are far from p, so the bound above can fail.
        assert tvd(torch.bincount(tokens[:, 0], minlength=V).float() / N, p) > 0.05


def test_lossless_bonus_and_second_position():
    """With γ = 2, the token at position 2 (second draft if accepted, else residual/bonus) is distributed as p_2
    given acceptance of the first; checked on rows that accepted the first draft."""
    N = 200_000
    p1, p2, p3 = random_dist(1), random_dist(2), random_dist(3)
    q1, q2 = random_dist(4), random_dist(5)
    g = torch.Generator().manual_seed(7)
    t1 = torch.multinomial(q1, N, replacement=True, generator=g)
    t2 = torch.multinomial(q2, N, replacement=True, generator=g)
    n, nxt = verify(torch.stack([q1, q2]).expand(N, 2, V), torch.stack([p1, p2, p3]).expand(N, 3, V),
                    torch.stack([t1, t2], 1), g)
    rows = n >= 1
    second = torch.where(n[rows] >= 2, t2[rows], nxt[rows])
    emp = torch.bincount(second, minlength=V).float() / rows.sum()
    assert tvd(emp, p2) < 0.015
    bonus = nxt[n == 2]
    assert len(bonus) > 1000
    assert tvd(torch.bincount(bonus, minlength=V).float() / len(bonus), p3) < noise_bound(p3, len(bonus))


def test_same_seed_same_result():
    p, q = random_dist(1), random_dist(2)
    tokens = torch.multinomial(q, 50 * 4, replacement=True, generator=torch.Generator().manual_seed(0)).view(50, 4)
    a = verify(q.expand(50, 4, V), p.expand(50, 5, V), tokens, torch.Generator().manual_seed(9))
    b = verify(q.expand(50, 4, V), p.expand(50, 5, V), tokens, torch.Generator().manual_seed(9))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_verify_greedy_equals_verify_on_one_hots():
    """Ids-only greedy verification gives what verify gives on the one-hot p and q, ragged γ_r included."""
    from decode.verify import verify_greedy

    g = torch.Generator().manual_seed(0)
    B, gamma, V = 64, 4, 5  # a small V makes matches (accepted drafts) frequent
    target_ids = torch.randint(0, V, (B, gamma + 1), generator=g)
    drafts = torch.where(torch.rand(B, gamma, generator=g) < 0.7, target_ids[:, :gamma],
                         torch.randint(0, V, (B, gamma), generator=g))
    p = torch.nn.functional.one_hot(target_ids, V).float()
    q = torch.nn.functional.one_hot(drafts, V).float()
    for num_draft in (None, torch.randint(0, gamma + 1, (B,), generator=g)):
        n_ref, nxt_ref = verify(q, p, drafts, accept_u=torch.rand(B, gamma, generator=g),
                                sample_u=torch.rand(B, generator=g), num_draft=num_draft)
        n, nxt = verify_greedy(target_ids, drafts, num_draft)
        assert n.tolist() == n_ref.tolist() and nxt.tolist() == nxt_ref.tolist()
        assert 0 < int((n == (num_draft if num_draft is not None else gamma)).sum()) < B  # both cases occur
