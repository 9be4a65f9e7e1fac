"""distill train with a draft whose tokenizer differs from the target's (distill/cross_vocab.py): the draft trains
through the token-level intersection (online and on the logit cache), is evaluated teacher-forced, resumes
exactly, keeps its own tokenizer in its checkpoints and export, and the export decodes greedy-equal to plain
greedy; settings that cannot work are refused before any model loads."""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from decode import SpeculativeDecoder
from decode.compat import vocab_fingerprint
from decode.cross_vocab import intersect_vocabularies
from decode.loading import load_causal_lm, load_tokenizer
from distill.__main__ import main
from distill.cache_logits import build_cache
from distill.config import SetupError
from distill.data import collate_sequences, kept_positions
from distill.evaluate import teacher_forced_sums
from distill.export import export
from distill.losses import pruned_distill_loss
import distill.recipe as recipe
from distill.recipe import draft_side, setup, train
from distill_helpers import compose, corpus_lines, overrides
from tests.decode.test_cross_vocab import byte_level_bpe, metaspace_bpe, transplant


def _quiet(*_):
    pass


@pytest.fixture(scope="module")
def cross(pair, tmp_path_factory):
    """The pair's target (byte-level BPE) with a draft of a SentencePiece-style BPE vocabulary trained on the same
    text, transplanted from the target (shared tokens keep their embedding and head rows) and saved with its
    tokenizer, as ``draft.name_or_path`` gives it."""
    folder = tmp_path_factory.mktemp("cross") / "draft"
    t_tok = load_tokenizer(str(pair["tokenizer"]))
    d_tok = metaspace_bpe(280, corpus=corpus_lines())  # 294 ids, 258 shared with the target's 300
    target = load_causal_lm(str(pair["target"]), "target")
    draft = transplant(target.double(), t_tok, d_tok, noise=0.5).float()
    draft.save_pretrained(str(folder))
    d_tok.save_pretrained(str(folder))
    return {**pair, "draft": folder, "t_tok": t_tok, "d_tok": d_tok}


def test_the_pair_really_has_two_vocabularies(cross):
    x = intersect_vocabularies(cross["t_tok"], cross["d_tok"])
    assert vocab_fingerprint(cross["t_tok"]) != vocab_fingerprint(cross["d_tok"])
    assert 0.5 < x.coverage < 0.9 and x.size < len(cross["d_tok"]) != len(cross["t_tok"])


def test_training_evaluates_checkpoints_and_resumes_exactly(cross, tmp_path, capsys):
    straight, split = tmp_path / "straight", tmp_path / "split"
    extra = ("eval.every=2", "train.max_steps=6", "optim.lr=3e-3")
    summary = train(compose(overrides(cross, straight, *extra)), log=print)
    assert "trains through the token-level intersection" in capsys.readouterr().out
    losses = [json.loads(line)["train/loss"] for line in open(straight / "metrics.jsonl") if "train/loss" in line]
    assert len(losses) == 6 and losses[-1] < losses[0]
    per_t = summary["last_eval"]["per_temperature"]
    assert summary["last_eval"]["method"] == "teacher_forced" and 0 < per_t["1.0"]["alpha"] < 1
    state = json.loads((straight / "step_000006" / "trainer_state.json").read_text())
    pairing = state["tokenizer_pairing"]
    assert pairing["draft_vocab_hash"] == vocab_fingerprint(cross["d_tok"])
    assert pairing["target_vocab_hash"] == vocab_fingerprint(cross["t_tok"])
    saved = load_tokenizer(str(straight / "step_000006" / "draft"))
    assert vocab_fingerprint(saved) == vocab_fingerprint(cross["d_tok"])  # the draft's own, not the target's

    train(compose(overrides(cross, split, "train.stop_at=3", *extra)), log=_quiet)
    train(compose(overrides(cross, split, "train.resume=true", *extra)), log=_quiet)
    ws = load_file(str(straight / "step_000006" / "model.safetensors"))
    wr = load_file(str(split / "step_000006" / "model.safetensors"))
    assert ws.keys() == wr.keys()
    for k in ws:
        assert torch.equal(ws[k], wr[k]), k


def test_training_on_the_logit_cache(cross, tmp_path):
    cache = tmp_path / "cache"
    build_cache(compose(overrides(cross, tmp_path / "c", f"data.logit_cache={cache}", "data.logit_cache_k=8")),
                log=_quiet)
    cfg = compose(overrides(cross, tmp_path / "run", f"data.logit_cache={cache}", "data.logit_cache_k=8",
                            "data.target_logits=cached", "train.max_steps=6", "optim.lr=3e-3"))
    summary = train(cfg, log=_quiet)
    losses = [json.loads(line)["train/loss"] for line in open(tmp_path / "run" / "metrics.jsonl")
              if "train/loss" in line]
    assert summary["steps"] == 6 and losses[-1] < losses[0] and all(x < float("inf") for x in losses)


def test_a_draft_that_is_the_target_on_shared_tokens_has_zero_fkl_and_alpha_the_shared_mass(cross):
    """Transplanted without noise, the draft computes the target's hidden states on a context of shared tokens and
    the target's logits at the shared ids: its q is the target's p renormalised over the intersection, so the
    (support-renormalised) FKL is 0 and the teacher-forced α at T = 1 is the target's mass on shared tokens."""
    t_tok, d_tok = cross["t_tok"], cross["d_tok"]
    target = load_causal_lm(str(cross["target"]), "target").double()
    draft = transplant(target, t_tok, d_tok, noise=0.0)
    x = intersect_vocabularies(t_tok, d_tok)
    g = torch.Generator().manual_seed(0)
    shared = x.target_ids[torch.randint(0, x.size, (4, 12), generator=g)]
    examples = [{"prompt_ids": s[:5].tolist(), "completion_ids": s[5:].tolist()} for s in shared]
    batch = collate_sequences(examples, t_tok.pad_token_id)
    where = kept_positions(batch["loss_mask"])
    run = SimpleNamespace(intersection=x, draft=draft, logits_to_keep={})
    with torch.no_grad():
        vocab_map, q_logits = draft_side(run, batch, where)  # the recipe's draft side: (N, K) over target ids
        p_kept = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[
            batch["loss_mask"].bool()]
    n = p_kept.shape[0]
    ones = torch.ones(1, n)
    fkl = pruned_distill_loss("fkl", q_logits.unsqueeze(0), p_kept.unsqueeze(0), vocab_map, ones, n)
    assert float(fkl) == pytest.approx(0.0, abs=1e-5)
    assert float(pruned_distill_loss("tvd", q_logits.unsqueeze(0), p_kept.unsqueeze(0), vocab_map, ones, n)) > 0
    sums, positions = teacher_forced_sums(target, draft, examples, [1.0], len(t_tok), t_tok.pad_token_id,
                                          intersection=x)
    shared_mass = p_kept.softmax(-1)[:, x.target_ids].sum(-1).mean()
    assert positions == n and sums[1.0] / positions == pytest.approx(float(shared_mass), abs=1e-5)


@pytest.mark.parametrize("extra,match", [
    (("draft.vocab.keep=50",), "draft.vocab.keep=50, but the draft has a tokenizer of its own"),
    (("data.on_policy_fraction=0.5",), "data.on_policy_fraction=0.5, but the draft has a tokenizer of its own"),
])
def test_what_cannot_work_is_refused_before_models_load(cross, tmp_path, monkeypatch, extra, match):
    monkeypatch.setattr(recipe, "load_target", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    with pytest.raises(SetupError, match=match):
        train(compose(overrides(cross, tmp_path / "run", *extra)), log=_quiet)


def test_export_keeps_the_draft_tokenizer_records_the_pairing_and_decodes_losslessly(cross, tmp_path):
    run = tmp_path / "run"
    train(compose(overrides(cross, run, "train.max_steps=2")), log=_quiet)
    out = tmp_path / "export"
    card = export(run / "best", out)
    exported_tok = load_tokenizer(str(out))
    assert vocab_fingerprint(exported_tok) == vocab_fingerprint(cross["d_tok"])
    pairing = card["tokenizer_pairing"]
    x = intersect_vocabularies(cross["t_tok"], cross["d_tok"])
    assert pairing["shared_tokens"] == x.size and pairing["coverage"] == pytest.approx(x.coverage)
    assert pairing["target_vocab_hash"] == vocab_fingerprint(cross["t_tok"])
    readme = (out / "README.md").read_text()
    assert "Timor et al." in readme and f"{x.size:,} tokens" in readme
    assert not card["engine_checks"]["draftkit_only"]
    problems = card["engine_checks"]["problems"]
    assert all(not p["error"] for p in problems)  # another vocab_size is a note for such a draft, not a refusal
    assert any(p["field"] == "vocab_size" and "use_heterogeneous_vocab" in p["what"] for p in problems)
    vllm = card["serving"]["vllm"]
    assert '"use_heterogeneous_vocab": true' in vllm and '"draft_sample_method": "greedy"' in vllm
    assert card["serving"]["sglang"] is None and "not run by draftkit" in readme

    target = load_causal_lm(str(cross["target"]), "target")
    draft = load_causal_lm(str(out), "draft")
    prompts = [cross["t_tok"](t)["input_ids"] for t in corpus_lines(4, seed=7)]
    plain = SpeculativeDecoder(target, None, 0).generate(prompts, max_new_tokens=16)
    spec = SpeculativeDecoder(target, draft, 3, tokenizer=cross["t_tok"],
                              draft_tokenizer=exported_tok).generate(prompts, max_new_tokens=16)
    assert all(torch.equal(a, b) for a, b in zip(plain.sequences, spec.sequences))
    for onward in (run / "best", out):  # training on from the run's checkpoint or the export keeps the pairing
        again = setup(compose(overrides(cross, tmp_path / "again", f"draft.name_or_path={onward}")), log=_quiet)
        assert again.intersection is not None and again.intersection.size == x.size


def test_generate_evaluation_measured_costs_and_distill_eval(cross, tmp_path, capsys):
    """eval.method=generate decodes through the intersection, c is measured on the pair's decoder, and
    python -m distill eval measures such a draft both ways."""
    ov = overrides(cross, tmp_path / "run", "train.max_steps=2", "eval.every=2", "eval.method=generate",
                   "eval.cost_ratio=null", "eval.max_gamma=2")
    summary = train(compose(ov), log=_quiet)
    ev = summary["last_eval"]
    assert ev["method"] == "generate" and 0 < ev["per_temperature"]["0.0"]["alpha"] <= 1 and ev["cost_ratio"] > 0
    for method in ("teacher_forced", "generate"):
        main(["eval", *overrides(cross, tmp_path / "e", f"eval.method={method}"), "--out",
              str(tmp_path / f"{method}.json")])
        result = json.loads((tmp_path / f"{method}.json").read_text())
        assert result["method"] == method and 0 < result["per_temperature"]["1.0"]["alpha"] < 1


def test_draft_tokenizer_key_gives_the_draft_s_tokenizer(cross, tmp_path):
    """draft.tokenizer names the draft's own tokenizer when its folder has none; without draft.name_or_path (a
    draft built from the target's config) it is refused."""
    bare, tok_dir = tmp_path / "bare", tmp_path / "tok"
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        if (cross["draft"] / f).exists():
            shutil.copy(cross["draft"] / f, bare / f)
    cross["d_tok"].save_pretrained(str(tok_dir))
    run = setup(compose(overrides(cross, tmp_path / "run", f"draft.name_or_path={bare}",
                                  f"draft.tokenizer={tok_dir}")), log=_quiet)
    assert run.intersection.size == intersect_vocabularies(cross["t_tok"], cross["d_tok"]).size
    ov = [o for o in overrides(cross, tmp_path / "built", f"draft.tokenizer={tok_dir}", "draft.num_hidden_layers=1")
          if not o.startswith("draft.name_or_path")]
    with pytest.raises(SetupError, match="draft.tokenizer=.* needs draft.name_or_path"):
        setup(compose(ov), log=_quiet)


def test_resuming_with_another_draft_tokenizer_is_refused_naming_draft_tokenizer(cross, tmp_path):
    """Found by a new user: a resume with another draft.tokenizer (or none, so the target's) trained the restored
    embedding rows under other tokens and kept the old pairing in the records."""
    bare, tok_dir, other_dir = tmp_path / "bare", tmp_path / "tok", tmp_path / "other"
    bare.mkdir()
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        if (cross["draft"] / f).exists():
            shutil.copy(cross["draft"] / f, bare / f)
    cross["d_tok"].save_pretrained(str(tok_dir))
    other = byte_level_bpe(300, corpus=corpus_lines())  # another vocabulary, the same text
    assert vocab_fingerprint(other) != vocab_fingerprint(cross["d_tok"])
    other.save_pretrained(str(other_dir))
    run = tmp_path / "run"
    base = (f"draft.name_or_path={bare}", "train.max_steps=2")
    train(compose(overrides(cross, run, *base, f"draft.tokenizer={tok_dir}")), log=_quiet)
    for tok in (f"draft.tokenizer={other_dir}", "draft.tokenizer=null"):
        with pytest.raises(SetupError, match=r"trained with a draft tokenizer .*Resume with draft\.tokenizer="):
            train(compose(overrides(cross, run, *base, tok, "train.max_steps=3", "train.resume=true")), log=_quiet)
    assert not (run / "step_000003").exists()
    train(compose(overrides(cross, run, *base, f"draft.tokenizer={run}/step_000002/draft", "train.max_steps=3",
                            "train.resume=true")), log=_quiet)
    assert (run / "step_000003").is_dir()
