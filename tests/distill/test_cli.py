"""The `python -m distill` command line: help, subcommand dispatch, and a 2-process CPU (gloo) accelerate launch."""
import json
import re
import subprocess

import pytest
import torch

from distill.__main__ import SUBCOMMANDS, main
from distill_helpers import PY, REPO, compose, overrides, subprocess_env


def test_help_lists_subcommands(capsys):
    main(["--help"])
    text = capsys.readouterr().out
    for name in ("train", "export", "generate-data", "eval", "cache-logits", "bench-step"):
        assert name in text and name in SUBCOMMANDS


def test_unknown_subcommand(capsys):
    with pytest.raises(SystemExit) as e:
        main(["fly"])
    assert e.value.code == 2 and "unknown subcommand 'fly'" in capsys.readouterr().err


def test_pretrain_is_the_quickstart_s_command(capsys):
    """Pretraining a pair is the quickstart program's job: the distill CLI names the command to run instead."""
    with pytest.raises(SystemExit) as e:
        main(["pretrain", "--size", "draft"])
    assert e.value.code == 2
    assert "python -m quickstart pretrain --size draft" in capsys.readouterr().err


def test_train_setup_error_exits_2(pair, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", *overrides(pair, tmp_path / "run", "data.on_policy_fraction=2")])
    assert e.value.code == 2 and "on_policy_fraction" in capsys.readouterr().err


def test_print_config(capsys):
    main(["train", "+target.name_or_path=org/t", "draft.num_hidden_layers=2", "loss=jsd", "--print-config"])
    text = capsys.readouterr().out
    assert "name: jsd" in text and "name_or_path: org/t" in text


def test_eval_with_its_own_prompts_does_not_need_the_training_data(pair, tmp_path):
    """eval with eval.prompts.path still checked (and read) data.source: a missing training file (an installed
    package's default mbpp path) refused an evaluation that never uses it."""
    ov = overrides(pair, tmp_path / "run", f"eval.prompts.path={pair['data']}",
                   f"data.source.path={tmp_path / 'missing.jsonl'}")
    main(["eval", *ov, "--out", str(tmp_path / "ev.json")])
    ev = json.loads((tmp_path / "ev.json").read_text())
    assert set(ev["per_temperature"]) == {"0.0", "1.0"}
    assert ev["method"] == "teacher_forced" and ev["per_temperature"]["0.0"]["num_positions"] > 0  # eval.method
    with pytest.raises(SystemExit) as e:  # training reads it: still refused before any model loads
        main(["train", *ov])
    assert e.value.code == 2


def test_hydra_config_dir_adds_experiments_that_the_checks_find_too(tmp_path, capsys):
    """--config-dir (listed in --help) was refused by the checks before Hydra ran: '+experiment=mine: no such
    option in conf/experiment/'."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntrain:\n  max_steps: 7\n")
    main(["train", "--config-dir", str(tmp_path), "+target.name_or_path=org/t", "draft.num_hidden_layers=2",
          "+experiment=mine", "--print-config"])
    assert "max_steps: 7" in capsys.readouterr().out
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(SystemExit) as e:  # Hydra takes the last --config-dir only: so do the checks
        main(["train", "-cd", str(tmp_path), "-cd", str(other), "+target.name_or_path=org/t", "+experiment=mine",
              "--print-config"])
    assert e.value.code == 2 and "+experiment=mine: no such option" in capsys.readouterr().err


def test_eval_and_generate_data_subcommands(pair, tmp_path, capsys):
    ov = overrides(pair, tmp_path / "run")
    main(["eval", *ov, "--out", str(tmp_path / "ev.json")])
    ev = json.loads((tmp_path / "ev.json").read_text())
    assert set(ev["per_temperature"]) == {"0.0", "1.0"} and 0 <= ev["acceptance_rate"] <= 1
    capsys.readouterr()
    main(["generate-data", *ov, "data.source.limit=12", "data.target_generated.shard_size=4"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["rows"] == 8  # 12 rows minus data.holdout=4, exactly what train() trains on
    import datasets

    ds = datasets.load_from_disk(res["path"])
    assert len(ds) == 8 and all(len(c) >= 1 for c in ds["completion_ids"])
    s_ov = [*ov, "data.source.limit=12", "data.target_generated.shard_size=4", "data.completions=target",
            "train.max_steps=1"]
    from distill.recipe import train
    from distill_helpers import compose

    assert train(compose(s_ov), log=lambda *_: None)["steps"] == 1  # reuses the cache


def test_generate_data_without_drafting_limits_prompts_by_the_draft_s_context_too(pair, tmp_path, capsys):
    """With data.target_generated.use_draft=false the draft was not loaded, so its shorter context did not cut the
    prompts: the cache was made for other examples than train() uses, and train refused it."""
    import shutil

    from distill.recipe import train
    from distill_helpers import compose, make_llama

    short = tmp_path / "short_draft"
    make_llama(short, vocab=pair["vocab"], layers=1, max_pos=20)
    for f in [*pair["draft"].glob("tok*"), *pair["draft"].glob("special_tokens_map.json")]:
        shutil.copy(f, short / f.name)
    ov = [*overrides(pair, tmp_path / "run", f"draft.name_or_path={short}", "data.truncate_prompts=true",
                     "data.source.limit=12", "data.target_generated.shard_size=4", "data.max_new_tokens=6",
                     "data.target_generated.use_draft=false")]
    main(["generate-data", *ov])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 8
    assert train(compose([*ov, "data.completions=target", "train.max_steps=1"]), log=lambda *_: None)["steps"] == 1


def test_accelerate_launch_two_cpu_processes(pair, tmp_path):
    """`accelerate launch` with 2 processes on CPU (gloo). Rank r takes micro-batch 2k+r, so 2 processes x batch 2
    see the same examples per step as 1 process x batch 4; with the window's token count taken over both
    processes, losses and weights must match the single-process run (DDP averaging is exact)."""
    from safetensors.torch import load_file

    from distill.recipe import train
    from distill_helpers import compose

    out = tmp_path / "ddp"
    cmd = [PY, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf/launcher/cpu_2proc.yaml"),
           "--num_processes", "2", "-m", "distill", "train",
           *overrides(pair, out, "train.max_steps=2", "eval.temperatures=[0.0]", "train.batch_size=2")]
    r = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["steps"] == 2
    assert (out / "step_000002" / "rng_state_1.safetensors").exists()  # one RNG state per process

    single = tmp_path / "single"
    ref = train(compose(overrides(pair, single, "train.max_steps=2", "eval.temperatures=[0.0]",
                                  "train.batch_size=4")), log=lambda *_: None)
    assert summary["tokens_seen"] == ref["tokens_seen"]
    losses = lambda d: [json.loads(line)["train/loss"] for line in open(d / "metrics.jsonl")  # noqa: E731
                        if "train/loss" in line]
    assert losses(out) == pytest.approx(losses(single), rel=1e-5)
    w2, w1 = (load_file(str(d / "step_000002" / "model.safetensors")) for d in (out, single))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)


def test_eval_and_continue_from_a_distill_checkpoint(pair, tmp_path, capsys):
    """draft.name_or_path may name a run's checkpoint folder (LoRA merged on load): eval it, or train on from it."""
    from distill.recipe import train
    from distill_helpers import compose

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.lora.enabled=true", "train.max_steps=1", "optim.lr=5e-2",
                            "eval.method=generate")), log=lambda *_: None)
    best = json.loads((run / "best" / "trainer_state.json").read_text())["last_eval"]
    out = tmp_path / "ev.json"
    main(["eval", *overrides(pair, tmp_path / "x", f"draft.name_or_path={run / 'best'}", "eval.method=generate"),
          "--out", str(out)])
    ev = json.loads(out.read_text())
    for t in ("0.0", "1.0"):  # same draft, prompts, seed: the recipe's last evaluation is reproduced
        assert ev["per_temperature"][t]["acceptance_rate"] == best["per_temperature"][t]["acceptance_rate"]
    s = train(compose(overrides(pair, tmp_path / "more", f"draft.name_or_path={run / 'best'}", "train.max_steps=1")),
              log=lambda *_: None)
    assert s["steps"] == 1


def test_the_recipe_evaluates_a_mixed_precision_run_as_distill_eval_measures_its_checkpoint(pair, tmp_path):
    """Found by a new user: under train.mixed_precision=bf16 the recipe's evaluation ran the draft inside
    accelerate's autocast wrapper, so eval.json and the export card stated numbers (0.364 at T = 1) that the saved
    draft, run as saved, does not reach (0.289)."""
    from distill.recipe import train
    from distill_helpers import compose

    run = tmp_path / "run"
    train(compose(overrides(pair, run, "train.mixed_precision=bf16", "train.max_steps=2", "optim.lr=5e-2",
                            "eval.num_prompts=4", "eval.max_new_tokens=16", "eval.method=generate")),
          log=lambda *_: None)
    best = json.loads((run / "best" / "trainer_state.json").read_text())["last_eval"]
    out = tmp_path / "ev.json"
    main(["eval", *overrides(pair, tmp_path / "x", f"draft.name_or_path={run / 'best'}",
                             "eval.num_prompts=4", "eval.max_new_tokens=16", "eval.method=generate"), "--out", str(out)])
    ev = json.loads(out.read_text())
    for t in ("0.0", "1.0"):
        for key in ("acceptance_rate", "alpha", "mean_accepted_length"):
            assert ev["per_temperature"][t][key] == best["per_temperature"][t][key], (t, key)


def test_cfg_job_prints_the_typed_config(capsys):
    main(["train", "+target=org/t", "draft.num_hidden_layers=2", "loss=jsd", "--cfg", "job"])
    text = capsys.readouterr().out
    assert "name: jsd" in text and "name_or_path: org/t" in text and "trust_remote_code: false" in text


def test_help_lists_groups_options_and_keys(capsys):
    with pytest.raises(SystemExit) as e:  # Hydra exits 0 after --help
        main(["train", "--help"])
    assert e.value.code in (0, None)
    text = capsys.readouterr().out
    assert "loss: acceptance, fkl, greedy_fkl, jsd, rkl, tvd" in text and "target: llama-3.1-8b-instruct" in text
    assert "on_policy_fraction: 0.0" in text and "--multirun" in text and "-m loss=fkl,tvd,jsd" in text


def test_misspelled_target_config_lists_the_configs(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "+target=qwen2.5-7b-instrct", "draft.num_hidden_layers=2"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "did you mean +target=qwen2.5-7b-instruct?" in err and "llama-3.1-8b-instruct" in err


def test_multirun_sweep_runs_each_job_into_its_own_folder(pair, tmp_path, capsys):
    out = tmp_path / "sweep"
    main(["train", *overrides(pair, out, "train.max_steps=1", "eval.at_start=false", "eval.temperatures=[0.0]"),
          "-m", "loss=fkl,tvd"])
    from omegaconf import OmegaConf

    for num, loss in ((0, "fkl"), (1, "tvd")):
        job = out / str(num)
        assert json.loads((job / "summary.json").read_text())["steps"] == 1
        assert OmegaConf.load(job / "config.yaml").loss.name == loss
        assert OmegaConf.load(job / "config.yaml").train.output_dir == str(job)
    assert (out / "multirun.yaml").exists()


@pytest.mark.parametrize("command,extra", [("eval", ["eval.max_new_tokens=4"]), ("bench-step", ["--steps", "1",
                                                                                      "--warmup", "0"]),
                                           ("cache-logits", ["data.logit_cache_k=4"])])
def test_an_eval_or_bench_step_sweep_writes_nothing_into_the_run_folder(pair, tmp_path, capsys, command, extra):
    """Found by a new user's trial: `eval -m` / `bench-step -m` (and cache-logits -m) made Hydra's sweep folder in
    train.output_dir (empty job folders, and a multirun.yaml that replaced a training sweep's), and a train there
    was then refused."""
    if command == "cache-logits":
        extra = [*extra, f"data.logit_cache={tmp_path / 'cache'}"]
    out = tmp_path / "run"
    out.mkdir()
    (out / "multirun.yaml").write_text("the training sweep's record")
    main([command, *overrides(pair, out, "eval.temperatures=[0.0]"), *extra, "-m", "eval.num_draft_tokens=1,2"])
    assert [p.name for p in out.iterdir()] == ["multirun.yaml"]
    assert (out / "multirun.yaml").read_text() == "the training sweep's record"
    assert re.search(r"^sweep job 1: .*eval\.num_draft_tokens=2$", capsys.readouterr().out, re.M)


def test_multirun_checks_every_job_before_the_first_runs(pair, tmp_path, capsys):
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) as e:
        main(["train", *overrides(pair, out), "-m", "loss.beta=0.5,2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "loss.beta=2.0 must be in [0, 1]" in err and "sweep job 1" in err
    assert not out.exists()  # job 0 did not run


def test_a_sweep_under_a_multi_process_launch_is_refused_before_anything_runs(pair, tmp_path, capsys, monkeypatch):
    """Under accelerate launch with 2 processes the sweep's second job hung forever in init_process_group."""
    out = tmp_path / "sweep"
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        main(["train", *overrides(pair, out), "-m", "loss=fkl,tvd"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "a Hydra sweep (-m) cannot run under a 2-process launch" in err
    assert "for loss in fkl tvd" in err and not out.exists()


def test_eval_out_is_checked_before_loading(pair, tmp_path, capsys):
    existing = tmp_path / "ev.json"
    existing.write_text("{}")
    with pytest.raises(SystemExit) as e:
        main(["eval", *overrides(pair, tmp_path / "run"), "--out", str(existing)])
    assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
    assert existing.read_text() == "{}"


def test_eval_refuses_a_keep_that_is_not_the_draft_s_own(pair, tmp_path, capsys, monkeypatch):
    """distill eval measured the draft as it is and ignored draft.vocab.keep: a user asking for keep=N got numbers
    for the full draft (or for another N) with no word. Refused before any model loads."""
    import transformers

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("a model loaded before the refusal"))
    with pytest.raises(SystemExit) as e:
        main(["eval", *overrides(pair, tmp_path / "run"), "draft.vocab.keep=50"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "draft.vocab.keep=50, but distill eval measures the draft as it is" in err
    assert "no vocabulary map" in err and "draft.vocab.keep=null" in err


def test_resume_a_one_process_run_with_two_processes_continues_at_its_example(pair, tmp_path):
    """#10's case: 1 process x batch 2 stops at step 2 (examples 0-3); resumed by 2 processes x batch 2, steps 3-4
    must train on examples 4-11, which is exactly what 1 process x batch 2 x accumulation 2 trains on from there
    (the old micro-batch formula skipped to example 8). Same update up to DDP's reduction order."""
    import shutil

    from safetensors.torch import load_file

    from distill.recipe import train
    from distill_helpers import compose

    base = ("train.batch_size=2", "data.shuffle=false", "eval.temperatures=[0.0]", "eval.at_start=false")
    one, two = tmp_path / "one", tmp_path / "two"
    train(compose(overrides(pair, one, "train.stop_at=2", *base)), log=lambda *_: None)
    shutil.copytree(one, two)
    cmd = [PY, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "conf/launcher/cpu_2proc.yaml"),
           "--num_processes", "2", "-m", "distill", "train", *overrides(pair, two, "train.resume=true", *base)]
    r = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "trained by 1 process(es), this run has 2; continuing at example 4" in r.stdout + r.stderr
    train(compose(overrides(pair, one, "train.resume=true", "train.grad_accum=2", *base)), log=lambda *_: None)
    for d in (one, two):
        assert json.loads((d / "step_000004" / "trainer_state.json").read_text())["examples_consumed"] == 12
    # the witness of which examples were trained: 6 straight steps of 1 x 2 see examples 0-11, and so many tokens
    straight = train(compose(overrides(pair, tmp_path / "straight", "train.max_steps=6", *base)), log=lambda *_: None)
    assert json.loads((two / "summary.json").read_text())["tokens_seen"] == straight["tokens_seen"]
    w1, w2 = (load_file(str(d / "step_000004" / "model.safetensors")) for d in (one, two))
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6)


def test_a_tied_draft_run_and_its_export_print_only_their_own_lines(pair, tmp_path):
    """A draft with tied embeddings saved through accelerate's save_state printed "Removed shared tensor" at every
    checkpoint, and every load printed weight-loading bars; the CLI prints only the run's own lines."""
    from distill_helpers import make_llama

    tied = tmp_path / "tied"
    make_llama(tied, pair["vocab"], layers=1, seed=3, tie=True)
    out, exported = tmp_path / "run", tmp_path / "export"
    for argv in (["train", *overrides(pair, out, f"draft.name_or_path={tied}", "eval.temperatures=[0.0]")],
                 ["export", str(out / "best"), str(exported)]):
        r = subprocess.run([PY, "-m", "distill", *argv], cwd=REPO, env=subprocess_env(), capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        for noise in ("Removed shared tensor", "Loading weights", "Writing model shards", "Generating train split",
                      "Warning"):
            assert noise not in r.stdout + r.stderr, (argv[0], noise, r.stderr[-2000:])
    assert json.loads((out / "summary.json").read_text())["steps"] == 4 and (exported / "config.json").is_file()


def test_eval_prompts_path_on_the_command_line(pair, tmp_path, capsys):
    """eval.prompts.path=FILE (what the docs and the holdout error tell users to type) composes and evaluates on
    that file; it used to crash in OmegaConf (AssertionError: Unexpected type for root: NoneType)."""
    from distill.config import eval_prompts_source
    from distill.data import load_data
    from distill.models import load_tokenizer

    prompts = tmp_path / "ev.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"q{i} def f():"}) + "\n" for i in range(5)))
    ov = overrides(pair, tmp_path / "run", f"eval.prompts.path={prompts}", "eval.prompts.prompt_field=question",
                   "eval.prompts.limit=3", "data.holdout=0", "eval.temperatures=[0.0]")
    cfg = compose(ov)
    assert eval_prompts_source(cfg).path == str(prompts)
    assert eval_prompts_source(compose(overrides(pair, tmp_path / "run"))) is None  # default: the holdout
    examples, ev = load_data(cfg, load_tokenizer(str(pair["tokenizer"])), None)
    assert len(ev) == 3 and len(examples) > 0  # nothing held out of training
    main(["eval", *ov, "--out", str(tmp_path / "ev.json")])
    assert 0 <= json.loads((tmp_path / "ev.json").read_text())["acceptance_rate"] <= 1


def test_ctrl_c_in_a_command_is_a_resume_hint_not_a_traceback(monkeypatch, capsys):
    """cache-logits, generate-data and export printed a raw KeyboardInterrupt traceback on Ctrl-C."""
    import distill.__main__ as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "export", interrupted)
    with pytest.raises(SystemExit) as e:
        main(["export", "a", "b"])
    assert e.value.code == 130
    assert "python -m distill export: interrupted (Ctrl-C or SIGTERM). What was saved is kept" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["eval", "bench-step"])
def test_overwrite_without_out_is_refused(command, capsys):
    """--overwrite with no --out was accepted silently (nothing is written without --out)."""
    with pytest.raises(SystemExit) as e:
        main([command, "--overwrite", "draft.num_hidden_layers=1"])
    assert e.value.code == 2 and "no --out was given" in capsys.readouterr().err



@pytest.mark.parametrize("command", ["eval", "bench-step"])
def test_out_followed_by_a_flag_is_refused(command, capsys, tmp_path, monkeypatch):
    """Found by a new user's trial: `--out --overwrite` took the flag as the file name (a file named --overwrite)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main([command, "--out", "--overwrite", "draft.num_hidden_layers=1"])
    assert e.value.code == 2 and f"--out needs a file name, e.g. --out results/{command}.json (got '--overwrite')" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([command, "--out=--overwrite", "draft.num_hidden_layers=1"])
    assert e.value.code == 2 and "(got '--overwrite')" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_documented_python_entry_point_trains_and_exports(pair, tmp_path):
    """docs/distill.md "From Python": distill.compose + recipe.train + export.export, as a library user calls them."""
    import distill
    from distill.export import export
    from distill.recipe import train

    out = tmp_path / "run"
    cfg = distill.compose(overrides(pair, out, "train.max_steps=2", "eval.at_start=false", "eval.temperatures=[0.0]"))
    summary = train(cfg, log=lambda *_: None)
    assert summary["steps"] == 2 and summary["output_dir"] == str(out)
    card = export(out / "best", tmp_path / "export")
    assert (tmp_path / "export" / "config.json").is_file() and card["steps"] == 2
    with pytest.raises(ValueError, match="overwrite=True from Python"):  # CheckpointError, a ValueError
        export(out / "best", tmp_path / "export")
