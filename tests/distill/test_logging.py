"""Progress reporting of a run (distill/logging.py, distill/evaluate.py): the cost-ratio measurement and each α/τ
evaluation report their progress, bars show it on a terminal, and nothing is drawn off a terminal or with
train.progress=none."""
import io
import re

import pytest

from distill.evaluate import COST_RATIO_PROGRESS, acceptance_eval
from distill.logging import Progress
from distill.recipe import train
from distill_helpers import compose, overrides


class Terminal(io.StringIO):
    """A text stream that says it is a terminal, so bars meant for one are drawn into it."""

    def isatty(self) -> bool:
        return True


def _counts(text: str, what: str) -> list[tuple[int, int]]:
    """(done, total) of every tqdm refresh of the bar called ``what``."""
    return [(int(a), int(b)) for a, b in re.findall(re.escape(what) + r":[^\r\n]*?\| *(\d+)/(\d+)", text)]


@pytest.fixture
def tiny_pair(pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(pair["target"]), AutoModelForCausalLM.from_pretrained(pair["draft"]),
            AutoTokenizer.from_pretrained(pair["tokenizer"]))


def test_acceptance_eval_reports_each_temperature_and_the_cost_ratio(tiny_pair):
    target, draft, tok = tiny_pair
    prompts = [[1, 5 + i, 6, 7] for i in range(5)]
    calls = []
    ev = acceptance_eval(target, draft, prompts, tok, [0.0, 1.0], max_new_tokens=4, batch_size=2,
                         progress=lambda *a: calls.append(a))
    cost = [c for c in calls if c[0] == COST_RATIO_PROGRESS]
    assert [c[1] for c in cost] == list(range(1, 10)) and {c[2:] for c in cost} == {(9, "rounds")}  # 7 + 2 rounds
    for t in ("0", "1"):
        mine = [c[1:] for c in calls if c[0] == f"eval α/τ T={t}"]
        assert mine == [(2, 5, "prompts"), (4, 5, "prompts"), (5, 5, "prompts")]  # batches of 2 of 5 prompts
    assert ev["cost_ratio"] > 0
    v = ev["verify_costs"]  # measured with c: v_0 = 1, then non-decreasing, up to max_gamma
    assert len(v) == 9 and v[0] == 1.0 and all(1.0 <= a <= b for a, b in zip(v, v[1:]))
    calls.clear()  # a given c is not measured, so only the evaluation reports
    acceptance_eval(target, draft, prompts, tok, [0.0], max_new_tokens=4, cost_ratio=0.5,
                    progress=lambda *a: calls.append(a))
    assert calls == [("eval α/τ T=0", 5, 5, "prompts")]


def test_acceptance_eval_predicts_with_the_verify_costs_it_is_given(tiny_pair):
    from decode.speedup import best_gamma, predicted_speedup

    target, draft, tok = tiny_pair
    prompts = [[1, 5 + i, 6, 7] for i in range(4)]
    plain = acceptance_eval(target, draft, prompts, tok, [1.0], max_new_tokens=8, cost_ratio=0.05)
    assert plain["verify_costs"] is None  # c given, no v_γ: Leviathan et al.'s v = 1
    steep = [1.0] + [1.0 + 0.5 * g for g in range(1, 9)]
    ev = acceptance_eval(target, draft, prompts, tok, [1.0], max_new_tokens=8, cost_ratio=0.05, verify_costs=steep)
    row, base = ev["per_temperature"]["1.0"], plain["per_temperature"]["1.0"]
    a = row["alpha"]
    assert row["acceptance_rate"] < a  # Σaccepted/Σdrafted counts the drafts after a rejection: below α
    assert a == base["alpha"]  # same seed, same draws: only the prediction changed
    assert row["best_gamma"] == best_gamma(a, 0.05, 8, 1, verify_costs=steep) <= base["best_gamma"]
    assert row["predicted_speedup"] == pytest.approx(predicted_speedup(a, row["best_gamma"], 0.05,
                                                                       steep[row["best_gamma"]]))
    assert row["predicted_speedup"] < base["predicted_speedup"] and ev["verify_costs"] == steep


def test_tqdm_bars_on_a_terminal_and_none_elsewhere():
    term = Terminal()
    with Progress("tqdm", file=term).reporting() as report:
        for i in range(1, 4):
            report("measuring cost ratio c", i, 3, "rounds")
        report("eval α/τ T=0", 2, 4, "prompts")  # left open: closed with the block
    text = term.getvalue()
    assert _counts(text, "measuring cost ratio c")[-1] == (3, 3)
    assert (2, 4) in _counts(text, "eval α/τ T=0")
    for kind, stream, enabled in (("tqdm", io.StringIO(), True), ("rich", io.StringIO(), True),
                                  ("none", Terminal(), True), ("tqdm", Terminal(), False)):
        with Progress(kind, enabled=enabled, file=stream).reporting() as report:  # not a TTY, none, not main
            report("eval α/τ T=0", 1, 2, "prompts")
            report("eval α/τ T=0", 2, 2, "prompts")
        assert stream.getvalue() == "", (kind, enabled)


def test_rich_bars_are_tasks_of_one_live_display():
    p = Progress("rich", file=Terminal())
    with p.bar("distill", 10, 3, unit="steps") as train_bar:
        with p.reporting() as report:
            report("eval α/τ T=0", 1, 4, "prompts")
            tasks = {t.description: (t.completed, t.total, t.fields["unit"]) for t in p.rich.tasks}
            assert tasks == {"distill": (3, 10, "steps"), "eval α/τ T=0": (1, 4, "prompts")}
            report("eval α/τ T=0", 4, 4, "prompts")
            assert [t.description for t in p.rich.tasks] == ["distill"]  # a finished measurement vanishes
        train_bar.update(advance=1, info="loss 1.0")
        assert p.rich.tasks[0].completed == 4 and p.rich.tasks[0].fields["info"] == "loss 1.0"
        live = p.rich
    assert p.rich is None and not live.live.is_started  # the display stops with its last bar


def test_train_shows_cost_ratio_and_eval_progress(pair, tmp_path, monkeypatch):
    """A run on a terminal with train.progress=tqdm draws the c measurement, each α/τ eval and the steps."""
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    out = tmp_path / "run"
    cfg = compose(overrides(pair, out, "train.progress=tqdm", "eval.cost_ratio=null", "eval.every=2",
                            "eval.batch_size=2", "train.max_steps=2"))
    train(cfg, log=lambda *_: None)
    text = term.getvalue()
    assert _counts(text, "measuring cost ratio c")[-1] == (9, 9)
    # teacher-forced (the default): one pass for every temperature, at start and at step 2, 4 sequences by 2
    assert _counts(text, "eval α teacher-forced").count((4, 4)) == 2
    assert (2, 4) in _counts(text, "eval α teacher-forced")
    assert _counts(text, "distill")[-1] == (2, 2)
    generating = Terminal()
    monkeypatch.setattr("sys.stderr", generating)
    train(compose(overrides(pair, tmp_path / "generate", "train.progress=tqdm", "eval.every=2", "eval.batch_size=2",
                            "train.max_steps=2", "eval.method=generate")), log=lambda *_: None)
    for t in ("0", "1"):  # eval.temperatures=[0.0,1.0]: at start and at step 2, 4 prompts in batches of 2
        assert _counts(generating.getvalue(), f"eval α/τ T={t}").count((4, 4)) == 2
        assert (2, 4) in _counts(generating.getvalue(), f"eval α/τ T={t}")
    quiet = Terminal()
    monkeypatch.setattr("sys.stderr", quiet)
    train(compose(overrides(pair, tmp_path / "quiet", "eval.cost_ratio=null", "eval.every=2", "train.max_steps=2")),
          log=lambda *_: None)  # train.progress=none
    assert "eval α" not in quiet.getvalue() and COST_RATIO_PROGRESS not in quiet.getvalue()


WANDB_NETRC = "machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n"


@pytest.mark.parametrize("env,netrc,expect", [
    ({"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}, None, "offline"),
    ({"WANDB_MODE": "disabled"}, None, "disabled"),
    ({"WANDB_API_KEY": "k" * 40}, None, "online"), ({}, None, "offline"),
    # `wandb login` keeps the key in ~/.netrc, not in the environment: such a user was logged offline
    ({}, WANDB_NETRC, "online"), ({"WANDB_MODE": "offline"}, WANDB_NETRC, "offline"),
    ({}, "machine example.com\n  login u\n  password p\n", "offline")])
def test_wandb_auto_mode_honours_wandb_mode(tmp_path, monkeypatch, env, netrc, expect):
    """logger.mode=auto passes $WANDB_MODE on (wandb.init's mode argument would override it: with an API key set,
    WANDB_MODE=offline went online and hung on a machine without network), and goes online for a logged-in user."""
    import types

    import wandb
    from omegaconf import OmegaConf

    from distill.logging import MetricsLogger

    for k in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    netrc_file = tmp_path / "netrc"  # never the machine's own ~/.netrc
    if netrc is not None:
        netrc_file.write_text(netrc)
    monkeypatch.setenv("NETRC", str(netrc_file))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}
    monkeypatch.setattr(wandb, "init",
                        lambda **kw: seen.update(kw) or types.SimpleNamespace(id="r1", finish=lambda **_: 0))
    cfg = OmegaConf.create({"logger": {"name": "wandb", "mode": "auto", "project": "p", "tags": []}})
    MetricsLogger(cfg, tmp_path, enabled=True, resumed=False).finish()
    assert seen["mode"] == expect


def test_a_full_disk_while_logging_metrics_warns_once_and_training_goes_on(tmp_path, capsys):
    """Found by a new user's full-disk trial: a metrics.jsonl write that the disk refused stopped the training with a
    traceback, though the checkpoints (which say so clearly now) are what a run keeps."""
    from omegaconf import OmegaConf

    from distill.logging import MetricsLogger

    logger = MetricsLogger(OmegaConf.create({"logger": {"name": "none"}}), tmp_path, enabled=True, resumed=False)
    logger.log({"train/loss": 1.0}, 1)
    logger.file.close()
    logger.file = open("/dev/full", "w")  # every write fails with ENOSPC, as on a full disk
    logger.log({"train/loss": 0.9, "pad": "x" * 10000}, 2)
    logger.log({"train/loss": 0.8}, 3)
    logger.finish()
    err = capsys.readouterr().err
    assert err.count("could not write /dev/full") == 1 and "No space left on device" in err
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == ['{"step": 1, "train/loss": 1.0}']
