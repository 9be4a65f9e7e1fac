"""Teacher-forced acceptance (distill.evaluate): the per-position math, agreement with the decoder's counted
acceptance, and the held-out responses a run generates once."""
from __future__ import annotations

import json

import pytest
import torch

from decode.engine import SpeculativeDecoder
from decode.vocab_map import prune_draft_head
from distill import evaluate
from distill.config import SetupError
from distill.evaluate import (acceptance_eval, expected_acceptance, heldout_examples, position_acceptance,
                              predicted_row, save_heldout, teacher_forced_alpha, teacher_forced_eval)


@pytest.fixture(scope="module")
def models(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = AutoModelForCausalLM.from_pretrained(pair["target"]).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair["draft"]).eval()
    return target, draft, AutoTokenizer.from_pretrained(pair["tokenizer"])


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, 200, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()]
            for _ in range(n)]


# ------------------------------------------------------------------------------------------------ the math

def test_expected_acceptance_of_identical_disjoint_and_a_hand_computed_pair():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.5, 0.0]])
    assert expected_acceptance(p, p).tolist() == pytest.approx([1.0, 1.0])
    disjoint = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert expected_acceptance(p[1:], disjoint[1:]).item() == 0.0
    q = torch.tensor([0.2, 0.3, 0.5])  # min: 0.2 + 0.3 + 0.2
    assert expected_acceptance(p[0], q).item() == pytest.approx(0.7)
    over = torch.full((4,), 0.25 + 1e-6)  # float round-off: Σ p a hair above 1 is still a probability of 1
    assert expected_acceptance(over, over).item() == 1.0


def test_greedy_acceptance_is_the_indicator_that_the_argmaxes_agree():
    target = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    draft = torch.tensor([[2.0, 0.5, 1.0], [0.0, 1.0, 5.0]])  # agrees on row 0 only
    assert position_acceptance(target, draft, 0.0, vocab=3).tolist() == [1.0, 0.0]
    # at T = 1 the same pair gives Σ min(softmax, softmax), strictly between
    beta = position_acceptance(target, draft, 1.0, vocab=3)
    ref = torch.minimum(target.softmax(-1), draft.softmax(-1)).sum(-1)
    torch.testing.assert_close(beta, ref)


def test_a_pruned_draft_puts_no_mass_outside_its_kept_ids():
    p_logits = torch.tensor([[0.5, 0.3, 0.2]]).log()
    kept = torch.tensor([0, 2])
    q_kept = torch.tensor([[0.0, 0.0]])  # uniform over ids 0 and 2: q = (0.5, 0, 0.5)
    beta = position_acceptance(p_logits, q_kept, 1.0, vocab=3, vocab_map=kept)
    assert beta.item() == pytest.approx(0.5 + 0.0 + 0.2)
    # greedy: the pruned draft's argmax maps back to its target id
    assert position_acceptance(p_logits, torch.tensor([[1.0, 0.0]]), 0.0, 3, kept).item() == 1.0
    assert position_acceptance(p_logits, torch.tensor([[0.0, 1.0]]), 0.0, 3, kept).item() == 0.0


def test_what_follows_from_alpha():
    full = predicted_row(1.0, 4, 0.1, None, 8)
    assert full["mean_accepted_length"] == 5.0 and full["acceptance_rate"] == 1.0
    assert full["accepted_length_histogram"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    none = predicted_row(0.0, 4, 0.1, None, 8)
    assert none["mean_accepted_length"] == 1.0 and none["acceptance_rate"] == 0.0
    half = predicted_row(0.5, 2, 0.1, None, 8)
    assert half["mean_accepted_length"] == pytest.approx(1.75)  # (1 − 0.5³) / 0.5
    assert half["acceptance_rate"] == pytest.approx(0.375)      # E[accepted] = 0.5 + 0.25, over γ = 2
    assert half["accepted_length_histogram"] == pytest.approx([0.5, 0.25, 0.25])
    assert half["acceptance_by_position"] == pytest.approx([0.5, 0.25])


# ------------------------------------------------------------------------------------------------ on models

def test_a_draft_identical_to_the_target_is_always_accepted_both_ways(models):
    target, _, tok = models
    ps = prompts(6)
    heldout = evaluate.greedy_completions(target, ps, 8, tok.eos_token_id, batch_size=4)
    seqs = [e["prompt_ids"] + e["completion_ids"] for e in heldout]
    alpha = teacher_forced_alpha(target, target, seqs, [len(p) for p in ps], [0.0, 1.0], pad_id=tok.pad_token_id)
    assert alpha == {0.0: pytest.approx(1.0, abs=1e-6), 1.0: pytest.approx(1.0, abs=1e-6)}
    generated = acceptance_eval(target, target, ps, tok, [0.0, 1.0], max_new_tokens=8, cost_ratio=0.5)
    assert [v["alpha"] for v in generated["per_temperature"].values()] == [1.0, 1.0]


def test_teacher_forced_alpha_matches_the_decoders_acceptance_on_the_targets_samples(models):
    """At T = 1, on 96 prompts × 24 tokens: the decoder's counted α (Σaccepted / Σtrials) and the mean β over the
    target's own samples estimate the same α. Each is a mean of ~1,500-2,300 terms in [0, 1] with variance at most
    α(1 − α) ≈ 0.25, so each has a standard error of about 0.012 and their difference about 0.017 (sequences
    correlate positions, which widens it somewhat); the decoder also skips trials at bonus positions, a bias far
    below that. 0.06 is about 3.5 standard errors: a wrong β (say T applied to one side only, or a missing
    normalisation) moves α by far more on this pair."""
    target, draft, tok = models
    ps = prompts(96, seed=3)
    dec = SpeculativeDecoder(target, None, num_draft_tokens=0)
    gen = torch.Generator().manual_seed(11)
    samples = dec.generate([list(p) for p in ps], max_new_tokens=24, temperature=1.0, eos_token_id=tok.eos_token_id,
                           generator=gen, num_draft_tokens=0).new_tokens
    seqs = [p + t.tolist() for p, t in zip(ps, samples)]
    forced = teacher_forced_alpha(target, draft, seqs, [len(p) for p in ps], [1.0], pad_id=tok.pad_token_id)[1.0]
    counted = acceptance_eval(target, draft, ps, tok, [1.0], num_draft_tokens=3, max_new_tokens=24, batch_size=16,
                              cost_ratio=0.5, seed=5)["per_temperature"]["1.0"]["alpha"]
    print(f"teacher-forced α {forced:.4f}, counted α {counted:.4f}")
    assert 0.1 < counted < 0.9  # a pair where agreement is informative
    assert forced == pytest.approx(counted, abs=0.06)


def test_teacher_forced_eval_has_the_generate_evals_keys(models):
    target, draft, tok = models
    heldout = evaluate.greedy_completions(target, prompts(5), 6, tok.eos_token_id)
    calls = []
    ev = teacher_forced_eval(target, draft, heldout, [0.0, 1.0], vocab=len(tok), num_draft_tokens=3,
                             cost_ratio=0.2, batch_size=2, pad_id=tok.pad_token_id, progress=lambda *a: calls.append(a))
    plain = acceptance_eval(target, draft, prompts(2), tok, [0.0], max_new_tokens=4, cost_ratio=0.2)
    assert ev["method"] == "teacher_forced" and plain["method"] == "generate"
    assert set(plain) == set(ev)
    assert set(plain["per_temperature"]["0.0"]) - {"num_new_tokens"} <= set(ev["per_temperature"]["0.0"])
    assert calls[-1] == ("eval α teacher-forced", 5, 5, "sequences")
    n = sum(len(e["completion_ids"]) for e in heldout)
    assert all(v["num_positions"] == n for v in ev["per_temperature"].values())
    seqs = [e["prompt_ids"] + e["completion_ids"] for e in heldout]
    alpha = teacher_forced_alpha(target, draft, seqs, [len(e["prompt_ids"]) for e in heldout], [0.0, 1.0],
                                 vocab=len(tok), pad_id=tok.pad_token_id)
    for t, a in alpha.items():  # batching changes α by float32 round-off only (other padding per batch)
        assert ev["per_temperature"][str(t)]["alpha"] == pytest.approx(a, abs=1e-6)


def test_a_pruned_draft_is_scored_through_its_map(models):
    import copy

    target, draft, tok = models
    heldout = evaluate.greedy_completions(target, prompts(4), 6, tok.eos_token_id)
    seqs = [e["prompt_ids"] + e["completion_ids"] for e in heldout]
    lens = [len(e["prompt_ids"]) for e in heldout]
    pruned = prune_draft_head(copy.deepcopy(draft), torch.arange(len(tok)), None)  # every id: same q
    full = teacher_forced_alpha(target, draft, seqs, lens, [0.0, 1.0], vocab=len(tok), pad_id=tok.pad_token_id)
    same = teacher_forced_alpha(target, pruned, seqs, lens, [0.0, 1.0], vocab=len(tok), pad_id=tok.pad_token_id)
    assert same == pytest.approx(full, abs=1e-6)
    # kept ids the greedy target never says here (its next token is its argmax): nothing is accepted at T = 0
    said = {t for e in heldout for t in e["completion_ids"]}
    never = torch.tensor([i for i in range(len(tok)) if i not in said][:2])
    none = prune_draft_head(copy.deepcopy(draft), never, None)
    assert teacher_forced_alpha(target, none, seqs, lens, [0.0], vocab=len(tok), pad_id=tok.pad_token_id)[0.0] == 0.0


def test_teacher_forced_alpha_refuses_what_it_cannot_score(models):
    target, draft, _ = models
    with pytest.raises(ValueError, match="2 sequences but 1 prompt lengths"):
        teacher_forced_alpha(target, draft, [[1, 2], [1, 3]], [1], [0.0])
    with pytest.raises(ValueError, match="no response token"):
        teacher_forced_alpha(target, draft, [[1, 2]], [2], [0.0])


# ------------------------------------------------------------------------------------------------ held-out text

def test_heldout_responses_are_generated_once_and_other_settings_are_refused(models, tmp_path, monkeypatch):
    target, _, tok = models
    ps, path = prompts(3), tmp_path / "eval_heldout.json"
    lines = []
    first, record = heldout_examples(path, target, "t", ps, 5, tok.eos_token_id, log=lines.append)
    assert len(lines) == 1 and not path.exists()  # the run writes it with its first write
    assert first == evaluate.greedy_completions(target, ps, 5, tok.eos_token_id)
    save_heldout(path, record)
    assert json.loads(path.read_text())["settings"]["max_new_tokens"] == 5
    monkeypatch.setattr(evaluate, "greedy_completions", lambda *a, **k: pytest.fail("generated again"))
    assert heldout_examples(path, target, "t", ps, 5, tok.eos_token_id) == (first, None)
    with pytest.raises(SetupError, match=r"max_new_tokens \(file 5, config 6; set by eval.max_new_tokens\)"):
        heldout_examples(path, target, "t", ps, 6, tok.eos_token_id)
    with pytest.raises(SetupError, match=r"prompts_hash .*held-out prompts"):
        heldout_examples(path, target, "t", prompts(3, seed=9), 5, tok.eos_token_id)
    path.write_text("{")
    with pytest.raises(SetupError, match="damaged; delete it"):
        heldout_examples(path, target, "t", ps, 5, tok.eos_token_id)
