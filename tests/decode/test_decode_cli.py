"""``python -m decode generate`` end to end on saved tiny checkpoints, in a subprocess like a user would run it."""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import make_tokenizer, perturbed_copy, tiny_llama


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    tok = make_tokenizer()
    target = tiny_llama(seed=0).float()
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.3))):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


def run(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "decode", *args], capture_output=True, text=True, env=env, timeout=300)


def test_generate_streams_text_and_prints_metrics(saved_pair):
    r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
            "--prompt", "w1 w2 w3", "--num-draft-tokens", "3", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    metrics = json.loads(r.stdout)  # with --json, stdout is one JSON document
    assert metrics["num_draft_tokens"] == 3 and 1 <= metrics["new_tokens"] <= 12
    assert 0.0 <= metrics["acceptance_rate"] <= 1.0 and metrics["mean_accepted_length"] >= 1.0
    assert metrics["prompt"] == "w1 w2 w3" and len(metrics["token_ids"]) == metrics["new_tokens"]
    assert metrics["text"] == make_tokenizer().decode(metrics["token_ids"], skip_special_tokens=True)
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1 w2 w3", "--max-new-tokens", "4")
    assert r.returncode == 0 and "w1 w2 w3" in r.stdout  # without --json the text streams to stdout


def test_generate_table_and_sampling(saved_pair):
    r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
            "--prompt", "w5", "-g", "auto", "--temperature", "0.8", "--top-p", "0.9", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "acceptance_rate" in r.stderr and "mean_accepted_length" in r.stderr


def test_missing_path_is_a_clear_error(saved_pair, tmp_path):
    r = run("generate", "--target", str(tmp_path / "nope"), "--prompt", "w1")
    assert r.returncode == 2
    assert "target path" in r.stderr and "does not exist" in r.stderr


def test_draft_with_a_different_tokenizer_is_refused(saved_pair, tmp_path):
    words = [f"w{i}" for i in range(92)]
    words[3] = "other"
    make_tokenizer(words).save_pretrained(tmp_path / "draft")
    tiny_llama(seed=2).float().save_pretrained(tmp_path / "draft")
    r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(tmp_path / "draft"), "--prompt", "w1")
    assert r.returncode == 2
    assert "map 1 shared ids to different tokens" in r.stderr and "Traceback" not in r.stderr


def test_unknown_command_and_bad_gamma(saved_pair):
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1", "-g", "-2")
    assert r.returncode == 2 and "num-draft-tokens" in r.stderr
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1", "--temperature", "inf")
    assert r.returncode == 2 and "finite" in r.stderr
