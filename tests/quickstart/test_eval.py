"""The quickstart's evaluation on tiny real models built here: Spec-Bench by its six categories, chat-template
prompts, runs that stop at eos, prompt lookup alone and Hugging Face assisted generation with a vocabulary-pruned
draft, every greedy output equal to plain greedy decoding's."""
import collections
import io
import json

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from decode.compat import vocab_fingerprint
from decode.loading import chat_prompt_ids
from decode.prompts import load_prompts as load_bench_prompts
from decode.vocab_map import draft_vocab_map, prune_draft_head
from quickstart.run import (MT_BENCH_CATEGORIES, SPEC_BENCH_GROUPS, FullVocabHead, HFAssisted, _full_vocab_draft,
                            check_eval_settings, encode_prompt_sets, evaluate, render_table, spec_bench_prompts)
from tests.conftest import VOCAB, make_tokenizer, perturbed_copy, tiny_llama
from tests.decode.server_helpers import CHAT_TEMPLATE
from tests.decode.test_engine import reference_greedy


def test_spec_bench_prompts_are_balanced_over_its_six_categories_and_calibration_prompts_are_new():
    timed = spec_bench_prompts(12)
    assert collections.Counter(g for g, _ in timed) == {g: 2 for g in SPEC_BENCH_GROUPS}
    assert [g for g, _ in timed[:6]] == list(SPEC_BENCH_GROUPS)
    category = {p.text: p.category for p in load_bench_prompts("spec_bench")}
    mt = [category[text] for g, text in timed if g == "mt_bench"]
    assert len(set(mt)) == 2 and set(mt) <= MT_BENCH_CATEGORIES  # MT-Bench's own categories take turns
    later = spec_bench_prompts(6, skip=12)
    assert [g for g, _ in later] == list(SPEC_BENCH_GROUPS)
    assert not {t for _, t in later} & {t for _, t in timed}


def test_chat_prompts_are_one_user_turn_and_the_cut_keeps_the_last_tokens_or_none():
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    text = spec_bench_prompts(1)[0][1]
    whole = chat_prompt_ids(tok, [{"role": "user", "content": text}])
    [(label, ids)] = encode_prompt_sets(tok, {"spec_bench": 1}, None, chat=True)
    assert (label, ids) == ("mt_bench", whole)
    assert encode_prompt_sets(tok, {"spec_bench": 1}, 5, chat=True) == [("mt_bench", whole[-5:])]
    assert encode_prompt_sets(tok, {"spec_bench": 1}, None) == [("mt_bench", tok(text)["input_ids"])]


def _pruned_draft(target, seed: int, tok):
    draft = perturbed_copy(target, 0.3, seed=seed)
    return prune_draft_head(draft, torch.arange(0, VOCAB, 2), vocab_fingerprint(tok))


def test_a_pruned_drafts_full_vocabulary_head_scores_its_map_and_nothing_else():
    tok = make_tokenizer()
    target = tiny_llama(seed=0)
    draft = _pruned_draft(target, 1, tok)
    x = torch.tensor([[5, 17, 33, 5]])
    pruned = draft(x).logits
    full = _full_vocab_draft(draft)(x).logits
    assert isinstance(draft.get_output_embeddings(), FullVocabHead) and full.shape[-1] == VOCAB
    assert torch.equal(full[..., draft_vocab_map(draft)], pruned)
    assert torch.isneginf(full[..., 1::2]).all()


def test_hf_assisted_generation_with_a_pruned_draft_gives_the_targets_greedy_output():
    tok = make_tokenizer()
    target = tiny_llama(seed=0, dtype=torch.float32)
    hf = HFAssisted(target, _full_vocab_draft(_pruned_draft(target, 1, tok).float()), pad_id=0)
    for prompt in ([5, 17, 33, 5, 17, 40, 8], [60, 3, 91, 12]):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, temperature=0.0,
                          generator=torch.Generator().manual_seed(0), num_draft_tokens=3)
        assert out.new_tokens[0].tolist() == reference_greedy(target, prompt, 20)
        assert out.stats.num_new_tokens == 20 and out.stats.total_s > 0
        assert out.sequences[0].tolist() == prompt + out.new_tokens[0].tolist()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A target (with a chat template and an eos it emits) and two drafts, the second vocabulary-pruned."""
    root = tmp_path_factory.mktemp("eval")
    target = tiny_llama(seed=0, dtype=torch.float32)
    emitted = reference_greedy(target, [3] * 8, 12)
    tok = make_tokenizer(eos_token=f"w{emitted[3] - 4}")  # a token the target emits: some runs stop early
    tok.chat_template = CHAT_TEMPLATE
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    perturbed_copy(target, 0.3, seed=1).save_pretrained(root / "step0")
    _pruned_draft(target, 2, tok).save_pretrained(root / "distilled")
    return root, tok


def _ecfg(**kw):
    cfg = dict(prompt_sets={"spec_bench": 6}, temperatures=[0.0, 1.0], num_draft_tokens=3, max_new_tokens=12,
               max_prompt_tokens=40, seed=0, compile=False, prompt_lookup_ngram=0, chat_template=True,
               ignore_eos=False, prompt_lookup_alone=2, hf_assisted="distilled")
    cfg.update(kw)
    return OmegaConf.create(cfg)


def test_evaluate_runs_every_mode_by_spec_bench_category_and_every_greedy_output_is_plain_greedy(checkpoints):
    root, tok = checkpoints
    console = Console(file=io.StringIO(), width=200)
    ev = evaluate(root / "target", {"step0": root / "step0", "distilled": root / "distilled"}, _ecfg(), console)
    assert ev["modes"] == ["step0", "distilled", "lookup", "hf_assisted"]
    assert ev["num_prompts"] == {g: 1 for g in SPEC_BENCH_GROUPS}
    assert [(r["temperature"], r["set"]) for r in ev["rows"]] == [
        (t, s) for t in (0.0, 1.0) for s in list(SPEC_BENCH_GROUPS) + ["all"]]
    assert ev["greedy_lossless"] == {"equal": 24, "total": 24,
                                     "by_mode": {"step0": 6, "distilled": 6, "lookup": 6, "hf_assisted": 6}}
    assert ev["eos_token_id"] == tok.eos_token_id and ev["chat_template"] is True
    everything = {r["temperature"]: r for r in ev["rows"] if r["set"] == "all"}
    assert everything[0.0]["plain_new_tokens"] < 6 * 12  # some run stopped at eos
    for t, row in everything.items():
        for mode in ev["modes"]:
            assert row[mode]["tokens_per_s"] > 0 and row[mode]["speedup"] > 0
        assert row["step0"]["alpha"] is not None and row["step0"]["predicted_speedup"] is not None
        assert row["hf_assisted"]["alpha"] is None and row["hf_assisted"]["num_draft_tokens"] == 3
    assert everything[0.0]["lookup"]["num_verify_steps"] > 0  # greedy: lookup drafted
    assert everything[1.0]["lookup"]["alpha"] is None  # sampled: plain steps only
    assert set(ev["draft_ratio"]["per_temperature"]) == {"0.0", "1.0"}
    json.dumps(ev)  # results.json keeps every number
    render_table({"eval": ev}, console)
    text = console.file.getvalue()
    assert "hf_assisted" in text and "lookup" in text and "translation (1)" in text
    assert "distilled vs step0 on all prompts" in text and "runs stop at eos" in text


def test_the_default_settings_keep_raw_prompts_and_ignore_eos(checkpoints):
    root, _ = checkpoints
    ev = evaluate(root / "target", {"baseline": root / "step0"},
                  _ecfg(prompt_sets={"humaneval": 2}, temperatures=[0.0], chat_template=False, ignore_eos=True,
                        prompt_lookup_alone=0, hf_assisted=None), Console(file=io.StringIO()))
    assert ev["modes"] == ["baseline"] and ev["draft_ratio"] is None and ev["eos_token_id"] is None
    assert ev["rows"][-1]["plain_new_tokens"] == 2 * 12
    assert ev["greedy_lossless"]["equal"] == ev["greedy_lossless"]["total"] == 2


@pytest.mark.parametrize("key,value,match", [
    ("chat_template", "yes", "chat_template='yes': use true or false"),
    ("ignore_eos", 1, "ignore_eos=1: use true or false"),
    ("prompt_lookup_alone", -1, "quickstart.eval.prompt_lookup_alone must be an integer >= 0"),
    ("hf_assisted", 3, "hf_assisted=3: give the name of a draft"),
    ("max_prompt_tokens", 0, "max_prompt_tokens=0 must be an integer >= 1"),
    ("prompt_sets", {"spec_bench": 6, "qa": 2}, "leave qa out"),
])
def test_bad_eval_settings_are_named(key, value, match):
    with pytest.raises(ValueError, match=match):
        check_eval_settings(_ecfg(**{key: value}))
    check_eval_settings(_ecfg(max_prompt_tokens=None))
