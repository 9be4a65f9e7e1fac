"""A pruned draft's kept ids measured on held-out target text (distill.vocab.heldout_coverage) and the warnings on
selection data too small to rank N ids or a low held-out coverage (selection_warnings)."""
import pytest
import torch

from distill.vocab import heldout_coverage, selection_warnings, target_id_mass


@pytest.fixture(scope="module")
def target_and_heldout(pair):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(pair["target"]).eval()
    heldout = [{"prompt_ids": [1, 5, 6], "completion_ids": [7, 8, 9, 7]},
               {"prompt_ids": [1, 20], "completion_ids": [30, 7]},
               {"prompt_ids": [1, 4], "completion_ids": []}]  # an empty response scores nothing
    return target, heldout, pair["vocab"]


def test_every_id_kept_covers_everything(target_and_heldout):
    target, heldout, vocab = target_and_heldout
    c = heldout_coverage(target, heldout, torch.arange(vocab), vocab, pad_id=0)
    assert c["heldout_mass"] == pytest.approx(1.0) and c["heldout_token_share"] == 1.0
    assert c["heldout_positions"] == 6


def test_a_subset_covers_its_share_of_tokens_and_of_the_targets_mass(target_and_heldout):
    target, heldout, vocab = target_and_heldout
    kept = torch.tensor([0, 1, 2, 7, 9])
    c = heldout_coverage(target, heldout, kept, vocab, pad_id=0, batch_size=1)
    assert c["heldout_token_share"] == pytest.approx(4 / 6)  # 7, 9, 7, 7 of 7 8 9 7 30 7
    mass = target_id_mass(target, heldout[:2], 0, vocab)  # Σ over the 6 response positions of p per id
    assert c["heldout_mass"] == pytest.approx(float(mass[kept].sum()) / 6, rel=1e-5)
    assert 0 < c["heldout_mass"] < 1


def test_no_response_is_refused(target_and_heldout):
    target, heldout, vocab = target_and_heldout
    with pytest.raises(ValueError, match="held-out responses"):
        heldout_coverage(target, heldout[2:], torch.arange(4), vocab, pad_id=0)


def test_warnings_name_the_keep_and_the_data_size_keys():
    assert selection_warnings(100, 2000, 0.97) == []  # exactly 20 positions per id and 97%: enough
    small, narrow = selection_warnings(100, 1999, 0.5)
    assert small.startswith("draft.vocab.keep=100 ids were chosen from 1999 scored positions, fewer than 20·100")
    assert "data.source.limit" in small and "data.max_new_tokens" in small and "lower draft.vocab.keep" in small
    assert narrow.startswith("draft.vocab.keep=100: the kept ids carry only 50.0%")
    assert "data.source.limit" in narrow and "raise draft.vocab.keep" in narrow
    assert selection_warnings(100) == []  # a map taken from a checkpoint, no held-out text: nothing to say
