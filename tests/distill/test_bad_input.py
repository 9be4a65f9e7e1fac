"""Every documented bad input raises a clear error naming the fix, before any model loads or any step runs.

The command-line cases are the table of docs/distill.md (dev/bad_inputs.py, which runs them as subprocesses);
here each runs in-process: exit code 2, the expected named error, no model or tokenizer loaded, no run folder.
"""
import json
import re

import pytest
import torch

from dev.bad_inputs import CASES, case_command, make_fixtures, run_case
from distill.__main__ import main
from distill.config import SetupError
from distill.recipe import train
from distill_helpers import compose, make_tokenizer, overrides


def _fails(pair, tmp_path, *extra, match):
    out = tmp_path / "run"
    with pytest.raises(SetupError, match=match):
        train(compose(overrides(pair, out, *extra)), log=lambda *_: None)
    assert not out.exists()  # no training happened, and the refused run left no folder (nor its lock file)


def test_missing_target_path(pair, tmp_path):
    ov = [o for o in overrides(pair, tmp_path / "run") if not o.startswith("+target")]
    with pytest.raises(SetupError, match=r"no target given.*\+target.name_or_path"):
        train(compose(ov))
    _fails(pair, tmp_path, f"++target.name_or_path={tmp_path / 'nowhere'}", match="target path .* does not exist")


def test_missing_draft_path(pair, tmp_path):
    _fails(pair, tmp_path, f"draft.name_or_path={tmp_path / 'nowhere'}", match="draft.name_or_path")
    _fails(pair, tmp_path, "draft.name_or_path=null", match="draft.num_hidden_layers")


def test_a_file_or_empty_folder_given_as_a_model_is_named_before_loading(pair, tmp_path):
    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    (tmp_path / "empty").mkdir()
    _fails(pair, tmp_path, f"draft.name_or_path={afile}", match="draft path .* is a file, not a checkpoint folder")
    _fails(pair, tmp_path, f"++target.name_or_path={afile}", match="target path .* is a file")
    _fails(pair, tmp_path, f"draft.name_or_path={tmp_path / 'empty'}", match="has no config.json")
    (tmp_path / "old_run").mkdir()  # found by a new user's trial: <run>/latest was "a file"; it names a checkpoint
    (tmp_path / "old_run" / "latest").write_text("step_000004")
    _fails(pair, tmp_path, f"draft.name_or_path={tmp_path / 'old_run' / 'latest'}",
           match=r"pointer to its newest checkpoint, not a folder; give that checkpoint: .*old_run/step_000004")
    from distill.checks import validate

    tok_only = tmp_path / "tok_only"  # in cached mode the target is never loaded: its tokenizer is enough
    make_tokenizer(tok_only)
    validate(compose(overrides(pair, tmp_path / "run", f"++target.name_or_path={tok_only}",
                               "data.target_logits=cached", f"data.logit_cache={tmp_path / 'cache'}")))
    with pytest.raises(SetupError, match="has no config.json"):
        validate(compose(overrides(pair, tmp_path / "run", f"++target.name_or_path={tok_only}")))


def test_output_paths_under_a_file_are_refused_before_loading(pair, tmp_path):
    from distill.export import check_export_dir

    afile = tmp_path / "afile.txt"
    afile.write_text("x")
    _fails(pair, tmp_path, f"train.output_dir={afile / 'run'}", match="train.output_dir.*lies under .*a file")
    with pytest.raises(SetupError, match="OUT_DIR.*lies under"):
        check_export_dir(afile / "exp")
    from distill.cache_logits import build_cache

    with pytest.raises(SetupError, match="data.logit_cache.*lies under"):
        build_cache(compose(overrides(pair, tmp_path / "run", "data.target_logits=cached",
                                      f"data.logit_cache={afile / 'cache'}")), log=lambda *_: None)


def test_a_refused_run_removes_every_folder_it_created(pair, tmp_path, monkeypatch):
    """Only the innermost folder went: nest/a stayed behind (a refusal while loading, after the run folder lock)."""
    import distill.recipe as recipe

    def refuse(*a, **k):
        raise SetupError("refused while loading")

    monkeypatch.setattr(recipe, "load_draft", refuse)
    (tmp_path / "nest").mkdir()
    out = tmp_path / "nest" / "a" / "b"
    with pytest.raises(SetupError, match="refused while loading"):
        train(compose(overrides(pair, out)), log=lambda *_: None)
    assert (tmp_path / "nest").is_dir() and not (tmp_path / "nest" / "a").exists()  # not a folder it did not make


def test_a_dangling_symlink_as_output_dir_is_named_as_one(pair, tmp_path):
    """It read "'.../dang' lies under '.../dang', which is a file"."""
    (tmp_path / "dang").symlink_to(tmp_path / "nowhere" / "x")
    with pytest.raises(SetupError, match=r"dang' is a symlink to '.*nowhere/x', which does not exist"):
        train(compose(overrides(pair, tmp_path / "dang")), log=lambda *_: None)


def test_a_draft_with_its_own_tokenizer_refuses_what_it_cannot_train_with(pair, tmp_path):
    """A draft whose tokenizer differs trains through the token-level intersection (test_cross_vocab_training.py);
    pruning its head is refused, naming the setting."""
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other_draft"
    AutoModelForCausalLM.from_pretrained(str(pair["draft"])).save_pretrained(str(other))
    tok = make_tokenizer(other, vocab_size=280)
    tok.add_special_tokens({"pad_token": "<pad2>"})
    tok.save_pretrained(str(other))
    _fails(pair, tmp_path, f"draft.name_or_path={other}", "draft.vocab.keep=50",
           match="draft.vocab.keep=50, but the draft has a tokenizer of its own")


def test_empty_data(pair, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    _fails(pair, tmp_path, f"data.source.path={empty}", match="empty")
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n")
    _fails(pair, tmp_path, f"data.source.path={few}", match="data.holdout")
    import datasets

    # a schema or header without rows: the datasets builders failed with "BatchSize must be greater than 0" or
    # 'Instruction "train" corresponds to no data!'
    datasets.Dataset.from_dict({"prompt": [], "completion": []}).to_parquet(str(tmp_path / "none.parquet"))
    (tmp_path / "none.csv").write_text("prompt,completion\n")
    for name, has in (("none.parquet", "a schema"), ("none.csv", "a header")):
        _fails(pair, tmp_path, f"data.source.path={tmp_path / name}", match=f"none.* has {has} but no rows")


def test_file_and_corpus_both_set(pair, tmp_path, monkeypatch):
    """An experiment that sets a corpus must not silently win over a file the user passed."""
    _fails(pair, tmp_path, "data.source.corpus=stdlib", match="both a corpus .* and a file")


def test_prompts_longer_than_context(pair, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text("\n".join(json.dumps({"prompt": "the draft " * 200, "completion": " x"}) for _ in range(8)))
    _fails(pair, tmp_path, f"data.source.path={long}", "data.max_prompt_tokens=1000",
           match=r"longer than 116 tokens.*context 128.*truncate_prompts=true")
    s = train(compose(overrides(pair, tmp_path / "ok", f"data.source.path={long}", "data.truncate_prompts=true",
                                "train.max_steps=1")), log=lambda *_: None)
    assert s["steps"] == 1


def test_unknown_loss_name(pair, tmp_path):
    _fails(pair, tmp_path, "loss.name=kld", match="loss.name='kld' is not allowed; choose one of fkl, rkl, jsd, tvd")
    with pytest.raises(SetupError, match="loss=kld: no such option in conf/loss/.*fkl, jsd, rkl, tvd"):
        compose(overrides(pair, tmp_path, "loss=kld"))


def _no_model_loading(monkeypatch):
    """Config errors must be caught before any model is loaded: loading now fails the test."""
    import transformers

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the config error was raised")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.mark.parametrize("lam", ["1.5", "-0.1"])
def test_on_policy_fraction_out_of_range(pair, tmp_path, lam, monkeypatch):
    _no_model_loading(monkeypatch)
    _fails(pair, tmp_path, f"data.on_policy_fraction={lam}", match=r"on_policy_fraction=.* must be in \[0, 1\]")


@pytest.mark.parametrize("override,match", [
    ("eval.temperatures=[-1]", "eval.temperatures"), ("eval.temperatures=[inf]", "eval.temperatures"),
    ("eval.num_draft_tokens=-1", "eval.num_draft_tokens"), ("data.rollout_temperature=-1", "rollout_temperature"),
    ("optim.lr=-1", "optim.lr"), ("eval.verify_costs=[1.0,0.5]", "eval.verify_costs"),
    ("eval.verify_costs=[1.2,1.5]", "eval.verify_costs"), ("eval.verify_costs=[]", "eval.verify_costs"),
    ("train.lora.target_modules=q_proj", r"single name.*train.lora.target_modules=\[q_proj\]"),
    ("eval.verify_costs=[1.0,1.1]", r"eval.verify_costs has 2 entries.*eval.max_gamma=8 needs v_0..v_8"),
    ("eval.num_draft_tokens=9", r"eval.num_draft_tokens=9 is larger than eval.max_new_tokens=8"),
    ("loss.ce_labels=target", r"loss.ce_labels=target .* loss.ce_weight is 0: give it a weight"),
    ("loss.ce_labels=argmax", r"loss.ce_labels"),
])
def test_eval_rollout_and_optim_values_checked_up_front(pair, tmp_path, override, match, monkeypatch):
    _no_model_loading(monkeypatch)
    _fails(pair, tmp_path, override, match=match)


@pytest.mark.parametrize("limit", ["-3", "0"])
def test_an_eval_prompts_limit_below_1_is_named(pair, tmp_path, limit, monkeypatch):
    """Found by a new user's trial: -3 was "data source ... is empty; point data.source at a file", 0 meant no
    limit; data.source.limit was checked, eval.prompts.limit not."""
    _no_model_loading(monkeypatch)
    _fails(pair, tmp_path, f"eval.prompts.path={pair['data']}", f"eval.prompts.limit={limit}",
           match=rf"eval.prompts.limit={limit} must be an integer >= 1")


def test_no_completions_without_on_policy(pair, tmp_path):
    _fails(pair, tmp_path, "data.source.completion_field=null",
           match="no completions.*on_policy_fraction=1.0.*completions=target")
    s = train(compose(overrides(pair, tmp_path / "ok", "data.source.completion_field=null",
                                "data.on_policy_fraction=1.0", "train.max_steps=1")), log=lambda *_: None)
    assert s["steps"] == 1


def test_a_target_without_a_tokenizer_names_the_distill_setting(pair, tmp_path):
    """The message told distill users to 'pass --tokenizer PATH', a flag of the decode CLIs."""
    import shutil

    bare = tmp_path / "bare_target"
    bare.mkdir()
    for f in pair["target"].iterdir():
        if f.is_file() and not f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, bare / f.name)
    ov = [o for o in overrides(pair, tmp_path / "run") if not o.startswith("+target")]
    with pytest.raises(SetupError, match=r"(?s)has no tokenizer files .* or set \+target.tokenizer=PATH") as e:
        train(compose([f"+target.name_or_path={bare}", *ov]), log=lambda *_: None)
    assert "--tokenizer" not in str(e.value)


def test_a_plus_for_a_key_the_experiment_sets_names_the_double_plus():
    """Hydra said 'Could not append to config. An item is already at ...' with no fix."""
    with pytest.raises(SetupError, match=r"\+target.name_or_path=/m: target.name_or_path is already set .* "
                                         r"replace it with \+\+target.name_or_path=/m"):
        compose(["+experiment=lora_seqkd_qwen", "+target.name_or_path=/m"])


def test_both_completions_without_fixed_ones_is_refused(pair, tmp_path):
    """data.completions=both with no completion field trained half its examples on zero tokens (loss 0, no
    gradient, a step of the schedule spent): refused before the target generates anything."""
    _fails(pair, tmp_path, "data.source.completion_field=null", "data.completions=both",
           match="data.completions=both .* the data has none.*Use data.completions=target")
    assert not (tmp_path / "run" / "target_data").exists()


def test_other_bad_values(pair, tmp_path):
    _fails(pair, tmp_path, "eval.select_by=loss", match="eval.select_by")
    _fails(pair, tmp_path, "loss.beta=2", match="loss.beta")
    _fails(pair, tmp_path, "data.completions=teacher", match="data.completions")
    _fails(pair, tmp_path, "train.lora.enabled=true", "train.lora.target_modules=[nope]", match="matches no module")


def test_hub_target_not_in_cache_offline(pair, tmp_path):
    ov = [o for o in overrides(pair, tmp_path / "run") if not o.startswith("+target")]
    with pytest.raises(SetupError, match=r"(?s)cannot load the .*'Qwen/Qwen2.5-7B-Instruct'.*\+target.name_or_path"):
        train(compose(["+target=qwen2.5-7b-instruct", *ov]), log=lambda *_: None)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return make_fixtures(tmp_path_factory.mktemp("bad_inputs"))


def _no_loading_at_all(monkeypatch):
    import transformers

    def refuse(*a, **k):
        raise AssertionError("a model or tokenizer was loaded before the bad input was reported")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", refuse)


@pytest.mark.parametrize("what,args,expect", CASES, ids=[c[0] for c in CASES])
def test_command_line_bad_input_exits_2_naming_the_setting(what, args, expect, fixtures, monkeypatch, capsys):
    from pathlib import Path

    from quickstart.__main__ import main as quickstart_main

    _no_loading_at_all(monkeypatch)
    module, argv = case_command(args, fixtures)
    with pytest.raises(SystemExit) as e:
        {"distill": main, "quickstart": quickstart_main}[module](argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert expect in err, err
    assert "Traceback" not in err and not (Path(fixtures["tmp"]) / "run").exists()


def test_at_least_30_documented_bad_inputs():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "distill.md").read_text()
    assert len(CASES) >= 30
    for what, _, _ in CASES:
        assert f"| {what} |" in doc, f"docs/distill.md's table lacks {what!r}: rerun python dev/bad_inputs.py --write"


def test_null_completion_and_missing_field_named_by_row_when_loading(pair, tmp_path):
    """The data loader names the row too (a file read without the start-up check, e.g. eval.prompts in code)."""
    from omegaconf import OmegaConf

    from distill.data import build_examples
    from distill.models import load_tokenizer

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n" + json.dumps({"prompt": "c", "completion": None}) + "\n")
    src = OmegaConf.create({"path": str(path), "kind": "prompts", "prompt_field": "prompt", "completion_field": "completion"})
    data = OmegaConf.create({"max_new_tokens": 4, "chat_template": False, "append_eos": True})
    with pytest.raises(SetupError, match="row 2: field 'completion' is null"):
        build_examples(src, load_tokenizer(str(pair["tokenizer"])), data)


@pytest.mark.parametrize("what", ["typo, as Hydra's hint suggests", "malformed JSON line", "scalar for a list",
                                  "negative pretrain budget"])
def test_real_process_exits_2_without_traceback(what, fixtures):
    """The same cases as a real `python -m distill` process (what dev/bad_inputs.py tabulates for the docs)."""
    _, args, expect = next(c for c in CASES if c[0] == what)
    r = run_case(*case_command(args, fixtures))
    assert r.returncode == 2 and expect in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("name", ["rows.jsonl.gz", "rows.txt.gz"])
def test_a_gz_data_file_that_is_not_whole_gzip_is_named_before_loading(tmp_path, name):
    """Plain text named .gz, or half a gzip file, was a gzip traceback (exit 1)."""
    import gzip

    from omegaconf import OmegaConf

    from distill.checks import preflight_source

    whole = gzip.compress("".join(f'{{"prompt": "{i}", "completion": "{"ab" * (i % 37)}"}}\n'
                                  for i in range(400)).encode())
    src = OmegaConf.create({"path": str(tmp_path / name), "kind": "prompts", "prompt_field": "prompt",
                            "completion_field": "completion"})
    for raw in (whole[: len(whole) // 2], b'{"prompt": "a", "completion": "b"}\n'):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(SetupError, match=f"{name}: not a whole gzip file .*data.source.path"):
            preflight_source(src, "data.source")


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz", "rows.txt", "rows.csv"])
def test_non_utf8_data_named_by_line_before_loading(tmp_path, name):
    """A latin-1 byte in a data file is a start-up error naming the file and line, not a UnicodeDecodeError
    traceback (JSON) or the datasets builder's DatasetGenerationError after the models loaded (txt, csv)."""
    import gzip

    from omegaconf import OmegaConf

    from distill.checks import preflight_source

    raw = b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n'
    path = tmp_path / name
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    src = OmegaConf.create({"path": str(path), "kind": "prompts", "prompt_field": "prompt",
                            "completion_field": "completion"})
    with pytest.raises(SetupError, match=r"rows\.[a-z.]+:2: not UTF-8 .*data.source.path"):
        preflight_source(src, "data.source")


def test_a_draft_that_cannot_embed_the_vocabulary_is_refused_naming_both_sizes(pair, tmp_path):
    """Found by a new user's trial: the decoder runs such a draft (a substitute id), but training fed it the target's
    ids and ended in an IndexError inside the draft's embedding."""
    from distill_helpers import make_llama
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(pair["target"]))
    make_llama(tmp_path / "small", vocab // 2, layers=1, seed=1)
    with pytest.raises(SetupError, match=rf"input embedding has {vocab // 2} rows but the shared vocabulary has "
                                         rf"{vocab} ids.*resize_token_embeddings\({vocab}\)"):
        train(compose(overrides({**pair, "draft": str(tmp_path / "small")}, tmp_path / "run")), log=lambda *_: None)


@pytest.mark.parametrize("role", ["target", "draft"])
def test_a_masked_lm_is_refused_as_target_or_draft(pair, tmp_path, role):
    """A trial trained against a BERT masked LM (AutoModelForCausalLM gives BertLMHeadModel with is_decoder=False,
    which attends to the tokens it should predict) with only transformers' own warning: α and the training signal
    meant nothing. The causal probe refuses it, naming the setting."""
    from transformers import AutoModelForCausalLM, BertConfig

    torch.manual_seed(0)
    from transformers import AutoConfig

    ids = {k: getattr(AutoConfig.from_pretrained(str(pair["target"])), k) for k in ("bos_token_id", "eos_token_id",
                                                                                   "pad_token_id")}
    bert = AutoModelForCausalLM.from_config(BertConfig(vocab_size=pair["vocab"], hidden_size=32, intermediate_size=64,
                                                       num_hidden_layers=2, num_attention_heads=4, **ids))
    bert.save_pretrained(str(tmp_path / "bert"))
    make_tokenizer(tmp_path / "bert")  # the pair's tokenizer (the same deterministic build)
    key = "++target.name_or_path" if role == "target" else "draft.name_or_path"
    _fails(pair, tmp_path, f"{key}={tmp_path / 'bert'}",
           match=rf"the {role} \(BertLMHeadModel\) is not a causal language model.*Set \+?"
                 rf"{re.escape(key.lstrip('+'))}")
