"""Run every bad input of the distill command line (and the quickstart's) and print the table of docs/distill.md.

    python dev/bad_inputs.py            # prints the table; exits 1 if any case is not exit 2 or shows a traceback
    python dev/bad_inputs.py --write    # also puts it between the bad-inputs markers of docs/distill.md

Each case runs ``python -m distill ...`` (``python -m quickstart ...`` for the quickstart's) in a subprocess against
throw-away fixtures (an empty "target" folder, a few small JSONL files): every one must exit with code 2, print one
``error:`` message naming the setting, print no traceback, load nothing, and leave no run folder. tests/distill/test_bad_input.py runs the same cases in-process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (what the user got wrong, arguments after `python -m distill`, text the error must contain). The arguments may
# use {tmp}, {target}, {good}, {empty}, {malformed}, {null_completion}, {a_file}, {old_run} (an earlier run's
# folder), {sweep} (a sweep folder whose job 1 holds a run) and {base} (the common overrides).
CASES: list[tuple[str, str, str]] = [
    ("λ not a number", "train {base} data.on_policy_fraction=half", "data.on_policy_fraction=half: expected a number"),
    ("λ out of range", "train {base} data.on_policy_fraction=1.5", "data.on_policy_fraction=1.5 must be in [0, 1]"),
    ("β not a number", "train {base} loss.beta=abc", "loss.beta=abc: expected a number"),
    ("β out of range", "train {base} loss.beta=2", "loss.beta=2.0 must be in [0, 1]"),
    ("steps not an integer", "train {base} train.max_steps=abc", "train.max_steps=abc: expected an integer"),
    ("steps empty", "train {base} train.max_steps=", "train.max_steps=: expected an integer"),
    ("scalar for a list", "train {base} eval.temperatures=0.5", "eval.temperatures=[0.5]"),
    ("negative temperature", "train {base} eval.temperatures=[-1]", "eval.temperatures has -1.0"),
    ("no temperatures", "train {base} eval.temperatures=[]", "eval.temperatures is empty"),
    ("eval batch 0", "train {base} eval.batch_size=0", "eval.batch_size=0 must be an integer >= 1"),
    ("eval prompts 0", "train {base} eval.num_prompts=0", "eval.num_prompts=0 must be an integer >= 1"),
    ("γ 0", "train {base} eval.num_draft_tokens=0", "eval.num_draft_tokens=0 must be an integer >= 1"),
    ("log every 0", "train {base} train.log_every=0", "train.log_every=0 must be an integer >= 1"),
    ("batch 0", "train {base} train.batch_size=0", "train.batch_size=0 must be an integer >= 1"),
    ("negative seed", "train {base} train.seed=-1", "train.seed=-1 must be an integer in [0, 4294967295]"),
    ("seed beyond numpy's range", "train {base} eval.seed=18446744073709551616",
     "eval.seed=18446744073709551616 must be an integer in [0, 4294967295]"),
    ("typo, as Hydra's hint suggests", "train {base} +train.max_step=5", "unknown setting train.max_step (did you mean train.max_steps?)"),
    ("typo", "train {base} train.max_step=5", "unknown setting train.max_step: did you mean train.max_steps?"),
    ("unknown loss option", "train {base} loss=kld", "loss=kld: no such option in conf/loss/"),
    ("unknown loss name", "train {base} loss.name=kld", "loss.name='kld' is not allowed; choose one of fkl"),
    ("misspelled target config", "train {base_no_target} +target=qwen2.5-7b-instrct", "did you mean +target=qwen2.5-7b-instruct?"),
    ("unknown experiment", "train {base} +experiment=nope", "+experiment=nope: no such option in conf/experiment/"),
    ("+ for a key the experiment sets", "train +experiment=lora_seqkd_qwen +target.name_or_path={target}",
     "target.name_or_path is already set (by the config or the +experiment); replace it with ++target.name_or_path="),
    ("no target", "train {base_no_target}", "no target given: pass +target=NAME"),
    ("target path missing", "train {base_no_target} +target.name_or_path={tmp}/no_such_target", "does not exist; fix +target.name_or_path"),
    ("draft path missing", "train {base} draft.name_or_path={tmp}/no_such_draft", "does not exist; fix draft.name_or_path"),
    ("no draft at all", "train {base} draft.num_hidden_layers=null", "no draft: set draft.name_or_path"),
    ("bad precision", "train {base} train.mixed_precision=fp8", "train.mixed_precision='fp8' is not allowed; choose one of no, bf16, fp16, auto"),
    ("fp16 on CPU", "train {base} train.mixed_precision=fp16", "train.mixed_precision=fp16 needs a CUDA GPU"),
    ("bad dtype", "train {base} +target.dtype=fp8", "target.dtype='fp8' is not allowed"),
    ("bad scheduler", "train {base} optim.scheduler=step", "optim.scheduler='step' is not allowed; choose one of cosine"),
    ("negative lr", "train {base} optim.lr=-1", "optim.lr=-1.0 must be a finite number > 0"),
    ("one beta", "train {base} optim.betas=[0.9]", "optim.betas=[0.9] must be two numbers"),
    ("bad completions source", "train {base} data.completions=teacher", "data.completions='teacher' is not allowed"),
    ("bad select_by", "train {base} eval.select_by=loss", "eval.select_by='loss' is not allowed"),
    ("bad progress", "train {base} train.progress=bar", "train.progress='bar' is not allowed; choose one of rich, tqdm, none"),
    ("unknown logger", "train {base} logger=mlflow", "logger=mlflow: no such option in conf/logger/"),
    ("bad source kind", "train {base} data.source.kind=lines", "data.source.kind='lines' is not allowed"),
    ("unknown corpus", "train {base} data.source.path=null data.source.corpus=wiki", "data.source.corpus='wiki' is not allowed"),
    ("file and corpus", "train {base} data.source.corpus=stdlib", "data.source names both a corpus"),
    ("jsonl without a path", "train {base_no_data} data=jsonl", "data.source has no data: set data.source.path=FILE"),
    ("data file missing", "train {base} data.source.path={tmp}/nope.jsonl", "data.source.path: data file"),
    ("data file empty", "train {base} data.source.path={empty}", "is empty"),
    ("malformed JSON line", "train {base} data.source.path={malformed}", "malformed.jsonl:3: not valid JSON"),
    ("null completion", "train {base} data.source.path={null_completion}", "null_completion.jsonl:2: \"completion\" is null"),
    ("missing field", "train {base} data.source.prompt_field=question", "field 'question' not found"),
    ("output folder is a file", "train {base} train.output_dir={a_file}", "train.output_dir="),
    ("run folder holds a run", "train {base} train.output_dir={old_run}", "already holds a run"),
    ("resume with nothing to resume", "train {base} train.resume=true", "has no complete checkpoint"),
    ("sweep job folder holds a run", "train {base} train.output_dir={sweep} -m loss=fkl,tvd", "sweep/1 already holds a run"),
    ("free-form key without +", "train {base} data.source.corpus_kwargs.max_items=3", "add a new entry with a plus"),
    ("eval --out folder missing", "eval {base} --out {tmp}/no_such_dir/x.json", "--out"),
    ("eval --out exists", "eval {base} --out {a_file}", "exists and would be overwritten"),
    ("eval bad value", "eval {base} eval.num_prompts=0", "eval.num_prompts=0 must be an integer >= 1"),
    ("generate-data bad value", "generate-data {base} data.target_generated.batch_size=0", "data.target_generated.batch_size=0"),
    ("acceptance window 0", "train {base} loss=acceptance loss.gamma=0", "loss.gamma=0 must be an integer >= 1"),
    ("acceptance on cached logits", "train {base} loss=acceptance data.target_logits=cached data.logit_cache={tmp}/cache", "loss=acceptance needs the target's full distribution"),
    ("bad target_logits", "train {base} data.target_logits=disk", "data.target_logits='disk' is not allowed"),
    ("negative time budget", "train {base} train.max_time_s=-5", "train.max_time_s=-5.0 must be >= 0"),
    ("cache-logits k 0", "cache-logits {base} data.logit_cache={tmp}/cache data.logit_cache_k=0", "data.logit_cache_k=0 must be an integer >= 1"),
    ("bench-step --steps 0", "bench-step {base} --steps 0", "--steps 0 must be >= 1"),
    ("bench-step --out exists", "bench-step {base} --out {a_file}", "exists and would be overwritten"),
    ("export missing checkpoint", "export {tmp}/no_such_ckpt {tmp}/export", "no_such_ckpt"),
    ("negative pretrain budget", "quickstart pretrain --budget-s -5 --out {tmp}/pt --tokenizer {tmp}/tok", "--budget-s -5"),
    ("unknown subcommand", "trian", "unknown subcommand 'trian' (did you mean train?)"),
    ("unknown flag", "train {base} --steps 5", "unknown option '--steps'"),
]


def make_fixtures(tmp: Path) -> dict[str, str]:
    """Files the cases refer to, under ``tmp``; returns the format fields of :data:`CASES`."""
    (tmp / "target").mkdir(parents=True, exist_ok=True)  # a config.json and no weights: no case may get as far
    (tmp / "target" / "config.json").write_text("{}\n")  # as loading
    rows = [{"prompt": f"def f{i}(x):", "completion": f" return x + {i}"} for i in range(8)]
    (tmp / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "empty.jsonl").write_text("")
    lines = [json.dumps(r) for r in rows]
    lines[2] = '{"prompt": "def g(x):", "completion": " return x"'  # line 3: the closing brace is missing
    (tmp / "malformed.jsonl").write_text("\n".join(lines) + "\n")
    rows_null = [dict(r) for r in rows]
    rows_null[1]["completion"] = None
    (tmp / "null_completion.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_null))
    (tmp / "a_file.txt").write_text("not a folder\n")
    for folder in (tmp / "old_run", tmp / "sweep" / "1"):  # an earlier run's folder (its metrics, no checkpoint)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 1.0}) + "\n")
    data = (f"data=jsonl data.source.path={tmp}/good.jsonl data.source.completion_field=completion "
            "data.holdout=2 eval.num_prompts=2")
    common = f"draft.num_hidden_layers=1 train.cpu=true train.output_dir={tmp}/run"
    return {"tmp": str(tmp), "target": str(tmp / "target"), "good": str(tmp / "good.jsonl"),
            "empty": str(tmp / "empty.jsonl"), "malformed": str(tmp / "malformed.jsonl"),
            "null_completion": str(tmp / "null_completion.jsonl"), "a_file": str(tmp / "a_file.txt"),
            "old_run": str(tmp / "old_run"), "sweep": str(tmp / "sweep"),
            "base": f"+target.name_or_path={tmp}/target {common} {data}",
            "base_no_target": f"{common} {data}",
            "base_no_data": f"+target.name_or_path={tmp}/target {common}"}


# A case's arguments follow ``python -m distill``, unless they start with one of these programs (``python -m NAME``).
PROGRAMS = ("quickstart",)


def case_command(args: str, fields: dict[str, str]) -> tuple[str, list[str]]:
    """(module, argv) of one case: ``python -m <module> <argv>``."""
    argv = args.format(**fields).split()
    return (argv[0], argv[1:]) if argv and argv[0] in PROGRAMS else ("distill", argv)


def run_case(module: str, argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO),
               TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", module, *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


START, END = "<!-- bad-inputs:start (dev/bad_inputs.py --write) -->", "<!-- bad-inputs:end -->"


def write_docs(table: str, doc: Path = REPO / "docs" / "distill.md") -> None:
    """Replace the text between the markers of ``doc`` with ``table``."""
    text = doc.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{START}\n{table}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--write", action="store_true",
                   help="also put the table between the bad-inputs markers of docs/distill.md")
    opts = p.parse_args(argv)  # --help, or a misspelled --write, stops here: no case runs, docs/ untouched
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        fields = make_fixtures(tmp)
        rows = []
        for what, args, expect in CASES:
            module, case_argv = case_command(args, fields)
            r = run_case(module, case_argv)
            err = r.stderr.strip().splitlines()
            message = next((line for line in err if line.startswith(("error:", f"python -m {module}"))), "")
            message = " ".join(err[err.index(message):]) if message in err else " ".join(err[-2:])
            ok = (r.returncode == 2 and "Traceback" not in r.stderr and expect in r.stderr
                  and not (tmp / "run").exists())
            bad += not ok
            shown = args.replace("{base} ", "").replace("{base_no_target} ", "").replace("{base_no_data} ", "")
            shown = shown.replace("{base}", "").replace("{base_no_target}", "").strip()
            shown = shown if module == "distill" else shown.split(" ", 1)[1]
            for key in ("tmp", "empty", "malformed", "null_completion", "a_file", "old_run", "sweep"):
                shown = shown.replace("{" + key + "}", f"<{key}>")
            rows.append(f"| {_md(what)} | `python -m {module} {_md(shown)}` | {r.returncode} | "
                        f"{_md(message.replace(str(tmp), '<tmp>'))} |" + ("" if ok else " **FAILED** |"))
    table = "\n".join(["| bad input | command | exit | error |", "| --- | --- | --- | --- |", *rows])
    print(table)
    if opts.write:
        write_docs(table)
    print(f"\n{len(CASES)} bad inputs, {len(CASES) - bad} exit 2 with a named error, no traceback, no run folder.",
          file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
