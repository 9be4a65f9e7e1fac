"""draft.vocab.keep=N in the recipe: the kept ids come from the target's mass on the training data (online pass or
logit cache), the pruned head and its map survive checkpoint, resume (exactly, never re-chosen), LoRA merge and
export, the exported draft decodes losslessly, and bad settings fail before training."""
import json

import pytest
import torch
from safetensors.torch import load_file

from decode import SpeculativeDecoder
from decode.compat import vocab_fingerprint
from decode.loading import load_causal_lm, load_tokenizer
from decode.vocab_map import HASH_FIELD, MAP_KEY, draft_vocab_map, select_kept_ids
from distill.checkpoint import CheckpointError
from distill.export import export
from distill.cache_logits import build_cache
from distill.config import SetupError
from distill.recipe import setup, train
from distill.vocab import special_ids, target_id_mass
from distill_helpers import compose, overrides

KEEP = 60


def _quiet(*_):
    pass


def test_training_a_pruned_draft_keeps_the_heaviest_ids_and_saves_them(pair, tmp_path):
    out = tmp_path / "run"
    cfg = compose(overrides(pair, out, f"draft.vocab.keep={KEEP}", "loss=jsd", "loss.ce_weight=0.1"))
    run = setup(cfg, log=_quiet)
    tok = run.tokenizer
    target = load_causal_lm(str(pair["target"]), "target")
    mass = target_id_mass(target, run.examples, tok.pad_token_id, run.vocab)
    expected = select_kept_ids(mass, KEEP, special_ids(tok, run.vocab))
    assert torch.equal(draft_vocab_map(run.draft).cpu(), expected)
    assert {tok.eos_token_id, tok.bos_token_id, tok.pad_token_id} <= set(expected.tolist())
    assert run.draft.get_output_embeddings().weight.shape[0] == KEEP
    assert run.draft.get_input_embeddings().weight.shape[0] == run.vocab

    summary = train(cfg, log=_quiet)
    assert summary["steps"] == 4
    losses = [json.loads(line)["train/loss"] for line in open(out / "metrics.jsonl") if "train/loss" in line]
    assert all(0.0 < x < float("inf") for x in losses)
    draft = load_causal_lm(str(out / "step_000004" / "draft"), "draft")
    assert torch.equal(draft_vocab_map(draft), expected)
    assert getattr(draft.config, HASH_FIELD) == vocab_fingerprint(tok)
    assert summary["last_eval"]["per_temperature"]["1.0"]["acceptance_rate"] > 0  # α measured through the decoder


@pytest.mark.parametrize("extra", [(), ("train.lora.enabled=true", "optim.lr=1e-2")], ids=["full", "lora"])
def test_resume_is_exact_and_reads_the_map_from_the_checkpoint(pair, tmp_path, monkeypatch, extra):
    straight, split = tmp_path / "straight", tmp_path / "split"
    keep = (f"draft.vocab.keep={KEEP}",)
    train(compose(overrides(pair, straight, *keep, *extra)), log=_quiet)
    train(compose(overrides(pair, split, "train.stop_at=2", *keep, *extra)), log=_quiet)
    import distill.vocab as vocab

    def no_new_selection(*a, **k):
        raise AssertionError("a resumed run chose its map again")

    monkeypatch.setattr(vocab, "target_id_mass", no_new_selection)
    with pytest.raises(SetupError, match=f"checkpoint .* was trained with a {KEEP}-id map"):  # another N: refused
        train(compose(overrides(pair, split, "train.resume=true", f"draft.vocab.keep={KEEP + 1}", *extra)),
              log=_quiet)
    with pytest.raises(SetupError, match=f"keep=null but the checkpoint .* was trained with a {KEEP}-id map.* "
                                         f"resume with draft.vocab.keep={KEEP}"):  # keep forgotten: named, not a
        train(compose(overrides(pair, split, "train.resume=true", *extra)), log=_quiet)  # state-dict size mismatch
    second = train(compose(overrides(pair, split, "train.resume=true", *keep, *extra)), log=_quiet)
    assert second["steps"] == 4
    ws, wr = load_file(str(straight / "step_000004" / "model.safetensors")), \
        load_file(str(split / "step_000004" / "model.safetensors"))
    assert ws.keys() == wr.keys() and any(k.endswith(MAP_KEY) for k in ws)
    for k in ws:
        assert torch.equal(ws[k], wr[k]), k


@pytest.mark.parametrize("extra", [(), ("train.lora.enabled=true",)], ids=["full", "lora"])
def test_checkpoint_map_is_read_without_model_safetensors(pair, tmp_path, extra):
    """A DeepSpeed/FSDP checkpoint keeps its weights under accelerate/, with no model.safetensors: the map comes
    from draft/ (or, for LoRA, the pruned draft_base). The old reader returned None, so a resumed sharded run chose
    its map again."""
    from distill.vocab import checkpoint_vocab_map

    run = tmp_path / "run"
    train(compose(overrides(pair, run, f"draft.vocab.keep={KEEP}", "train.max_steps=2", *extra)), log=_quiet)
    step = run / "step_000002"
    want = checkpoint_vocab_map(step)
    assert want is not None and want.numel() == KEEP
    (step / "model.safetensors").unlink()  # the layout of a sharded checkpoint
    assert torch.equal(checkpoint_vocab_map(step), want)


def test_resuming_a_full_vocabulary_run_with_keep_is_refused_before_choosing_ids(pair, tmp_path, monkeypatch):
    """The checkpoint's head has V rows: pruning now could not load it. Refused naming the setting, before the
    target pass that would choose a map (the old code chose one, then failed on a state-dict size mismatch)."""
    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.stop_at=2")), log=_quiet)
    import distill.vocab as vocab

    monkeypatch.setattr(vocab, "target_id_mass", lambda *a, **k: (_ for _ in ()).throw(AssertionError("chosen")))
    with pytest.raises(SetupError, match=f"keep={KEEP} but the checkpoint .* has a full-vocabulary head.*"
                                         "draft.vocab.keep=null"):
        train(compose(overrides(pair, run, "train.resume=true", f"draft.vocab.keep={KEEP}")), log=_quiet)


@pytest.mark.parametrize("extra", [(), ("train.lora.enabled=true", "optim.lr=5e-2")], ids=["full", "lora"])
def test_export_of_a_pruned_draft_reloads_and_decodes_losslessly(pair, tmp_path, extra):
    run = tmp_path / "run"
    train(compose(overrides(pair, run, f"draft.vocab.keep={KEEP}", "train.max_steps=2", *extra)), log=_quiet)
    out = tmp_path / "export"
    card = export(run / "best", out)
    assert card["draft_vocab"]["kept_ids"] == KEEP and card["draft_vocab"]["vocab_size"] == pair["vocab"]
    readme = (out / "README.md").read_text()
    assert f"scores {KEEP} of the target's" in readme
    # The card's Use/Serve lines run where the map is read: no from_pretrained/assistant_model, vLLM or SGLang line
    # (the old card printed them, and the first fails on the N-row head); its Python snippet runs as written.
    assert "assistant_model" not in readme and "vllm serve" not in readme and "sglang" not in readme
    assert "library_name: transformers" not in readme  # the hub's transformers snippet fails on the N-row head
    assert card["serving"]["vllm"] is None and card["serving"]["sglang"] is None
    assert card["serving"]["draftkit"] in readme and "python -m decode serve" in card["serving"]["draftkit"]
    snippet = readme.split("```python\n", 1)[1].split("```", 1)[0].replace("max_new_tokens=128", "max_new_tokens=4")
    scope = {}
    exec(snippet, scope)
    assert len(scope["out"].sequences[0]) > len(scope["prompt_ids"])
    draft = load_causal_lm(str(out), "draft")
    from distill.export import load_checkpoint_draft

    trained = load_checkpoint_draft(run / "best")[0]  # base + adapter merged (LoRA) or the saved draft
    ids = torch.tensor([[1, 20, 33, 47, 60, 71]])
    torch.testing.assert_close(draft(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)
    assert draft.get_output_embeddings().weight.shape[0] == KEEP
    assert torch.equal(draft_vocab_map(draft), draft_vocab_map(trained))
    if extra:  # best/draft is the adapter: it named the full-vocabulary draft as its base, so every loader built
        # the 8192-row head plus the adapter without a word; it names the pruned draft_base and loads merged
        adapter = json.loads((run / "best" / "draft" / "adapter_config.json").read_text())
        assert adapter["base_model_name_or_path"] == str((run / "draft_base").resolve())
        merged = load_causal_lm(str(run / "best" / "draft"), "draft")
        torch.testing.assert_close(merged(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(draft_vocab_map(merged), draft_vocab_map(trained))
        with pytest.raises(CheckpointError, match=r"pruned draft \(60 ids\) but the LoRA base .* a full head"):
            export(run / "best", tmp_path / "full-base", lora_base=pair["draft"])  # was the raw size mismatch
        assert not (tmp_path / "full-base").exists()
        # and it trains on as a draft: loaded as transformers' adapter integration, the first save failed
        onward = tmp_path / "onward"
        train(compose(overrides(pair, onward, f"draft.name_or_path={run / 'best' / 'draft'}", "train.max_steps=2")),
              log=_quiet)
        assert torch.equal(draft_vocab_map(load_causal_lm(str(onward / "step_000002" / "draft"), "draft")),
                           draft_vocab_map(trained))
    from quickstart.run import _load_lm  # the quickstart's evaluation loads it the same way

    assert torch.equal(draft_vocab_map(_load_lm(out)), draft_vocab_map(draft))

    target = load_causal_lm(str(pair["target"]), "target")
    tok = load_tokenizer(str(pair["tokenizer"]))
    prompts = [[1, 20, 33, 47], [1, 9, 100, 4, 5, 6]]
    plain = SpeculativeDecoder(target, None, 0).generate(prompts, max_new_tokens=16)
    spec = SpeculativeDecoder(target, draft, 3, tokenizer=tok).generate(prompts, max_new_tokens=16)
    assert all(torch.equal(a, b) for a, b in zip(plain.sequences, spec.sequences))

    # Training on from the pruned export keeps its map (keep=null or its own size), and refuses another size.
    again = tmp_path / "again"
    cfg = compose(overrides(pair, again, f"draft.name_or_path={out}", "train.max_steps=1"))
    assert torch.equal(draft_vocab_map(setup(cfg, log=_quiet).draft).cpu(), draft_vocab_map(draft))
    with pytest.raises(SetupError, match=f"already pruned to {KEEP} ids"):
        setup(compose(overrides(pair, again, f"draft.name_or_path={out}", "draft.vocab.keep=30")), log=_quiet)


def test_a_target_tokenizer_without_pad_trains_exports_and_decodes(pair, tmp_path, capsys):
    """Llama-style tokenizers have no pad token: training adds eos as pad and saves that tokenizer (and its hash in
    the map); `python -m decode generate` loads the target's own. It exited 2 (pad 2 vs None, then the map's
    tokenizer hash); the same tokenizer must pass."""
    import shutil

    from decode.__main__ import main
    from transformers import AutoTokenizer

    target, draft = tmp_path / "target", tmp_path / "draft"
    tok = AutoTokenizer.from_pretrained(str(pair["tokenizer"]))
    tok.pad_token = None
    for src, dst in ((pair["target"], target), (pair["draft"], draft)):
        shutil.copytree(src, dst)
        for f in dst.glob("tokenizer*"):
            f.unlink()
        tok.save_pretrained(str(dst))
    no_pad = {**pair, "target": target, "draft": draft}
    train(compose(overrides(no_pad, tmp_path / "run", f"draft.vocab.keep={KEEP}", "train.max_steps=2")), log=_quiet)
    export(tmp_path / "run" / "best", tmp_path / "export")
    assert load_tokenizer(str(target)).pad_token_id is None
    argv = ["generate", "--target", str(target), "--draft", str(tmp_path / "export"), "--prompt", "the draft",
            "--max-new-tokens", "4", "--device", "cpu", "--json"]
    assert main(argv) == 0, capsys.readouterr().err


def test_cached_mode_chooses_from_the_cache(pair, tmp_path, monkeypatch):
    V = pair["vocab"]
    cache_dir = tmp_path / "cache"
    base = [f"data.logit_cache={cache_dir}", f"data.logit_cache_k={V}"]
    build_cache(compose(overrides(pair, tmp_path / "c", *base)), log=_quiet)
    online = setup(compose(overrides(pair, tmp_path / "o", f"draft.vocab.keep={KEEP}")), log=_quiet)
    import distill.vocab as vocab

    monkeypatch.setattr(vocab, "target_id_mass", lambda *a, **k: (_ for _ in ()).throw(AssertionError("pass")))
    cfg = compose(overrides(pair, tmp_path / "cached", f"draft.vocab.keep={KEEP}", "data.target_logits=cached",
                            *base))
    cached = setup(cfg, log=_quiet)
    # Every id cached (k = V): the same mass up to fp16 storage, so (nearly) the same ids.
    same = set(draft_vocab_map(cached.draft).tolist()) & set(draft_vocab_map(online.draft).tolist())
    assert len(same) >= KEEP - 3
    summary = train(cfg, log=_quiet)
    assert summary["steps"] == 4 and 0 < summary["final_loss"] < float("inf")


@pytest.mark.parametrize("extra,match", [
    (("draft.vocab.keep=100000",), r"draft.vocab.keep=100000 must be an integer in \[3, "),
    (("draft.vocab.keep=0",), "draft.vocab.keep=0 must be an integer >= 1"),
    (("draft.vocab.keep=50", "data.on_policy_fraction=0.5"), "on-policy rollouts"),
])
def test_bad_settings_fail_before_training(pair, tmp_path, extra, match):
    with pytest.raises(SetupError, match=match):
        train(compose(overrides(pair, tmp_path / "run", *extra)), log=_quiet)


def test_target_id_mass_sums_the_targets_probabilities_at_completion_positions():
    from tests.conftest import tiny_llama

    target = tiny_llama(seed=0, dtype=torch.float32)
    examples = [{"prompt_ids": [1, 5, 9], "completion_ids": [7, 3]}, {"prompt_ids": [1, 4], "completion_ids": [8]}]
    mass = target_id_mass(target, examples, pad_id=0, vocab=96, batch_size=1)
    want = torch.zeros(96, dtype=torch.float64)
    for e in examples:
        seq = torch.tensor([e["prompt_ids"] + e["completion_ids"]])
        probs = target(seq).logits[0].softmax(-1).double()
        for pos in range(len(e["prompt_ids"]) - 1, seq.shape[1] - 1):  # positions that predict a completion token
            want += probs[pos].detach()
    torch.testing.assert_close(mass, want, rtol=1e-5, atol=1e-7)
    assert mass.sum().item() == pytest.approx(3.0, rel=1e-5)  # one unit of probability per completion token


def test_cache_id_mass_sums_the_cached_top_k_probabilities():
    from types import SimpleNamespace

    from distill.vocab import cache_id_mass

    log_p = torch.log(torch.tensor([[0.5, 0.2, 0.3], [0.6, 0.1, 0.3], [0.9, 0.05, 0.05]]))
    ids = torch.tensor([[4, 2], [2, 7], [4, 1]])
    # a stand-in with the LogitCache interface: one position per row, rows 0 and 1 (row 2 is not in the cache)
    cache = SimpleNamespace(ds=[0, 1], buckets=lambda rows: (log_p[rows], ids[rows], None))
    mass, positions = cache_id_mass(cache, 8, rows_per_read=1)
    want = torch.zeros(8, dtype=torch.float64)
    want[4], want[2], want[7] = 0.5, 0.2 + 0.6, 0.1
    torch.testing.assert_close(mass, want, rtol=1e-6, atol=1e-9)
    assert positions == 2
    # with sampled tail ids, each row's tail mass (0.3) is split over its draws: an estimate of the tail ids' mass
    tails = torch.tensor([[3, 3, 5], [6, 3, 6], [0, 0, 0]])
    cache = SimpleNamespace(ds=[0, 1], buckets=lambda rows: (log_p[rows], ids[rows], tails[rows]))
    mass, positions = cache_id_mass(cache, 8, rows_per_read=2)
    want[3], want[5], want[6] = 0.2 + 0.1, 0.1, 0.2
    torch.testing.assert_close(mass, want, rtol=1e-6, atol=1e-9)
    assert float(mass.sum()) == pytest.approx(positions)
