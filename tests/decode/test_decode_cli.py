"""``python -m decode generate`` end to end on saved tiny checkpoints, in a subprocess like a user would run it."""
import json
import os
import subprocess
import sys

import pytest

from decode import SpeculativeDecoder, costs
from decode.__main__ import cmd_generate
from decode.prompts import load_prompts
from tests.conftest import VOCAB, make_tokenizer, perturbed_copy, tiny_llama
from tests.decode.server_helpers import CHAT_TEMPLATE


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


def test_generate_with_prompt_lookup_gives_the_same_greedy_text(saved_pair):
    outs = []
    for extra in ([], ["--prompt-lookup-ngram", "1"]):
        r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                "--prompt", "w1 w2 w1 w2 w1", "--max-new-tokens", "16", "--json", *extra)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) >= 1
    r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--prompt", "w1",
            "--max-new-tokens", "2", "--temperature", "0.5", "--prompt-lookup-ngram", "1")
    assert r.returncode == 0 and "note: --prompt-lookup-ngram does nothing here" in r.stderr  # said, not silent


def test_generate_streams_text_and_prints_metrics(saved_pair):
    r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
            "--prompt", "w5", "--num-draft-tokens", "3", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    metrics = json.loads(r.stdout)  # with --json, stdout is one JSON document
    assert metrics["num_draft_tokens"] == 3 and 2 <= metrics["new_tokens"] <= 12  # w5 has no eos first
    assert 0.0 <= metrics["acceptance_rate"] <= metrics["alpha"] <= 1.0 and metrics["mean_accepted_length"] >= 1.0
    assert metrics["prompt"] == "w5" and len(metrics["token_ids"]) == metrics["new_tokens"]
    assert metrics["text"] == make_tokenizer().decode(metrics["token_ids"], skip_special_tokens=True)
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1 w2 w3", "--max-new-tokens", "4")
    assert r.returncode == 0 and "w1 w2 w3" in r.stdout  # without --json the text streams to stdout


def test_generate_without_a_draft_reports_no_acceptance_rate(saved_pair):
    """Plain decoding drafts nothing: its acceptance rate is absent (null), not a 0.0 that reads as 'all rejected'."""
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1 w2", "--max-new-tokens", "4",
            "--json")
    assert r.returncode == 0, r.stderr
    metrics = json.loads(r.stdout)
    assert metrics["acceptance_rate"] is None and metrics["alpha"] is None and metrics["acceptance_by_position"] == []
    assert metrics["num_draft_tokens"] == 0 and metrics["mean_accepted_length"] == 1.0
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1 w2", "--max-new-tokens", "4")
    assert r.returncode == 0 and "nothing drafted" in r.stderr
    # an explicit γ without a draft ran plain decoding silently (the Python API refuses it)
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1 w2", "-g", "4")
    assert r.returncode == 2 and "--num-draft-tokens 4 needs a draft: pass --draft PATH" in r.stderr
    r = run("generate", "--target", str(saved_pair / "target"), "--draft=", "--prompt", "w1 w2", "-g", "4")
    assert r.returncode == 2 and "needs a draft" in r.stderr  # an empty --draft is no draft
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1 w2", "-g", "0", "--max-new-tokens", "2")
    assert r.returncode == 0, r.stderr


def test_generate_table_and_sampling(saved_pair):
    r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
            "--prompt", "w5", "-g", "auto", "--temperature", "0.8", "--top-p", "0.9", "--max-new-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert "acceptance_rate" in r.stderr and "mean_accepted_length" in r.stderr
    assert "Loading weights" not in r.stderr  # no per-model weight-loading bars


def test_generate_defaults_to_auto_and_warns_when_a_fixed_gamma_predicts_a_slowdown(saved_pair, tmp_path):
    """Found by a new user: a weak draft (α 0.05) ran at the default γ = 4, slower than the target alone, and nothing
    said so. With a draft the default is auto; a fixed γ whose measured acceptance predicts a slowdown says so."""
    tiny_llama(seed=7).float().save_pretrained(tmp_path / "unrelated")  # a draft that guesses at random
    make_tokenizer().save_pretrained(tmp_path / "unrelated")
    common = ("generate", "--target", str(saved_pair / "target"), "--draft", str(tmp_path / "unrelated"), "--prompt",
              "w5", "--max-new-tokens", "16")
    r = run(*common, "-g", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["num_draft_tokens"] == 4 and out["alpha"] < 0.5
    assert "γ = 4 is predicted to run at" in r.stderr and "slower than the target alone: use --num-draft-tokens " \
        "auto (the default) or 0, or a better draft" in r.stderr
    r = run(*common, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_draft_tokens"] == "auto" and "predicted to run at" not in r.stderr
    r = run(*common, "-g", "0", "--json")
    assert r.returncode == 0 and "predicted to run at" not in r.stderr


def test_generate_measures_auto_gamma_s_costs_before_the_run(saved_pair, monkeypatch, capsys):
    """At the default auto γ the cost model was measured inside the first step: its timed forwards counted in the
    run's TTFT and per-token latency (seconds on a real pair)."""
    calls = []
    calibrate, generate = costs.calibrate, SpeculativeDecoder.generate
    monkeypatch.setattr(costs, "calibrate", lambda *a, **k: calls.append("calibrate") or calibrate(*a, **k))
    monkeypatch.setattr(SpeculativeDecoder, "generate", lambda *a, **k: calls.append("generate") or generate(*a, **k))
    assert cmd_generate(["--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"), "--prompt",
                         "w5", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_draft_tokens"] == "auto" and calls == ["calibrate", "generate"]


def test_missing_path_is_a_clear_error(saved_pair, tmp_path):
    r = run("generate", "--target", str(tmp_path / "nope"), "--prompt", "w1")
    assert r.returncode == 2
    assert "target path" in r.stderr and "does not exist" in r.stderr


def test_draft_with_a_different_tokenizer_drafts_through_the_shared_tokens(saved_pair, tmp_path):
    """A draft whose own tokenizer has another vocabulary is no longer refused: it drafts through the tokens both
    share (docs/decode.md, "Drafts with their own tokenizer"), warns once, and the output is the target's."""
    words = [f"w{i}" for i in range(92)]
    words[3] = "other"
    make_tokenizer(words).save_pretrained(tmp_path / "draft")
    tiny_llama(seed=2).float().save_pretrained(tmp_path / "draft")
    ask = ["--target", str(saved_pair / "target"), "--prompt", "w1 w5", "--max-new-tokens", "8", "--json"]
    plain = run("generate", *ask)
    r = run("generate", *ask, "--draft", str(tmp_path / "draft"), "-g", "2")
    assert r.returncode == 0 and "tokens shared" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["token_ids"] == json.loads(plain.stdout)["token_ids"]


def test_unknown_command_and_bad_gamma(saved_pair):
    r = run("frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1", "-g", "-2")
    assert r.returncode == 2 and "num-draft-tokens" in r.stderr
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w1", "--temperature", "inf")
    assert r.returncode == 2 and "finite" in r.stderr


@pytest.mark.parametrize("command,args,message", [
    ("generate", ["--device", "tpu"], "device 'tpu' is not a torch device"),
    ("generate", ["--seed", str(10**23)], "--seed must be in"),
    ("generate", ["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ("generate", ["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    ("generate", ["--top-k", "0"], "--top-k must be an integer >= 1"),
    ("generate", ["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    ("generate", ["--prompt-lookup-ngram", "-1"], "--prompt-lookup-ngram must be an integer >= 0"),
    ("generate", ["--prompt-lookup-ngram", "3"], "--prompt-lookup-ngram=3 needs a draft model"),
    ("bench", ["--prompt-lookup-ngram", "-2"], "--prompt-lookup-ngram (prompt_lookup_ngram) must be an integer >= 0"),
    ("bench", ["--device", "tpu"], "device 'tpu' is not a torch device"),
    ("bench", ["--threads", "-1"], "--threads must be >= 1"),
    ("bench", ["--prompt-field", "nosuch", "--limit", "1"], "no field 'nosuch'"),
    ("certify", ["--device", "tpu"], "device 'tpu' is not a torch device"),
    ("certify", ["--prompt-field", "nosuch"], "no field 'nosuch'"),
])
def test_bad_device_seed_threads_and_prompt_field_exit_2_naming_the_option(saved_pair, tmp_path, command, args,
                                                                          message):
    """Found by a new user: these were tracebacks (exit 1), some after both models had loaded."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    common = {"generate": ["--prompt", "w1"], "bench": ["--draft", str(saved_pair / "draft"), "--prompts",
                                                         str(prompts), "--out", str(tmp_path / "b.json")],
              "certify": ["--draft", str(saved_pair / "draft"), "--prompts", str(prompts)]}[command]
    r = run(command, "--target", str(saved_pair / "target"), *common, *args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_a_tokenizer_of_another_vocabulary_than_the_target_s_own_is_refused(saved_pair, tmp_path):
    """Found by a new user: --tokenizer with two ids swapped decoded the target with it, silently."""
    words = [f"w{i}" for i in range(VOCAB - 4)]
    words[5], words[6] = words[6], words[5]
    make_tokenizer(words).save_pretrained(tmp_path / "swapped")
    templated = make_tokenizer()
    templated.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    templated.save_pretrained(tmp_path / "templated")  # another template over the same vocabulary: fine
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w1 w2"}) + "\n")
    common = {"generate": ["--prompt", "w1", "--max-new-tokens", "2"],
              "bench": ["--prompts", str(prompts), "--out", str(tmp_path / "b.json")],
              "certify": ["--prompts", str(prompts)]}
    for command, extra in common.items():
        r = run(command, "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
                "--tokenizer", str(tmp_path / "swapped"), *extra)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (command, r.stderr)
        assert f"--tokenizer {tmp_path / 'swapped'} does not fit the target: the target's own tokenizer and " \
               f"--tokenizer (both {VOCAB} ids) map 2 shared ids to different tokens (the target's own tokenizer vs " \
               "--tokenizer: id 9 'w5' vs 'w6'" in r.stderr, (command, r.stderr)
        assert "leave --tokenizer out to use the target's own" in r.stderr
    extra = make_tokenizer()
    extra.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    extra.save_pretrained(tmp_path / "extra")  # one token more: refused naming --tokenizer (re-test trial)
    r = run("generate", "--target", str(saved_pair / "target"), "--tokenizer", str(tmp_path / "extra"), "--prompt",
            "w1", "--max-new-tokens", "2")
    assert r.returncode == 2 and f"--tokenizer {tmp_path / 'extra'} does not fit the target: it has {VOCAB + 1} " \
                                 f"tokens, the target's own tokenizer" in r.stderr, r.stderr
    r = run("generate", "--target", str(saved_pair / "target"), "--tokenizer", str(tmp_path / "swapped"), "--prompt",
            "w1", "--max-new-tokens", "2")  # no draft: this decoded with the swapped ids, exit 0
    assert r.returncode == 2 and "does not fit the target" in r.stderr
    r = run("generate", "--target", str(saved_pair / "target"), "--draft", str(saved_pair / "draft"),
            "--tokenizer", str(tmp_path / "templated"), "--prompt", "w1", "--max-new-tokens", "2", "--chat")
    assert r.returncode == 0, r.stderr


def test_a_checkpoint_file_instead_of_its_folder_is_named_as_such(saved_pair):
    r = run("generate", "--target", str(saved_pair / "target" / "config.json"), "--prompt", "w1")
    assert r.returncode == 2 and "is a file, not a checkpoint folder" in r.stderr


def test_prompt_file_rows_must_be_objects(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="not an object"):
        load_prompts(str(bad))


def test_generate_stops_at_every_eos_of_the_generation_config(saved_pair, tmp_path):
    """The stop set is tokenizer eos ∪ generation_config eos: a second eos id X ends the output at X."""
    from transformers import AutoModelForCausalLM

    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w5", "--max-new-tokens", "16",
            "--json")
    free = json.loads(r.stdout)["token_ids"]
    k = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i] and t != 2)
    target = AutoModelForCausalLM.from_pretrained(saved_pair / "target")
    target.generation_config.eos_token_id = [2, free[k]]
    target.save_pretrained(tmp_path / "target")
    make_tokenizer().save_pretrained(tmp_path / "target")
    r = run("generate", "--target", str(tmp_path / "target"), "--draft", str(saved_pair / "draft"), "-g", "3",
            "--prompt", "w5", "--max-new-tokens", "16", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == free[: k + 1]


def test_generate_chat_uses_the_template(saved_pair, tmp_path):
    """transformers 5's apply_chat_template returns a dict; --chat must still build the prompt from it."""
    tok = make_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    target = tiny_llama(seed=0).float()
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    r = run("generate", "--target", str(tmp_path / "target"), "--prompt", "w4 w5", "--chat", "--max-new-tokens", "6",
            "--json")
    assert r.returncode == 0, r.stderr
    ids = tok("w4 w5 w9")["input_ids"]  # what the template renders, with the generation prompt
    direct = SpeculativeDecoder(target, None, 0).generate([ids], max_new_tokens=6, eos_token_id=2)
    assert json.loads(r.stdout)["token_ids"] == direct.new_tokens[0].tolist()
    r = run("generate", "--target", str(saved_pair / "target"), "--prompt", "w4", "--chat")
    assert r.returncode == 2 and "no chat template" in r.stderr and "Traceback" not in r.stderr


def test_generate_chat_streams_the_answer_only(tmp_path):
    """--chat streamed the whole rendered prompt, the template's hidden system prompt included, before the answer;
    a plain prompt still streams with its continuation."""
    tok = make_tokenizer()
    tok.chat_template = "w7 w8 " + CHAT_TEMPLATE  # a template with a system prompt the user never wrote
    tiny_llama(seed=0).float().save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    common = ("generate", "--target", str(tmp_path / "target"), "--prompt", "w4 w5", "--max-new-tokens", "6")
    answer = json.loads(run(*common, "--chat", "--json").stdout)
    r = run(*common, "--chat")
    assert r.returncode == 0, r.stderr
    assert answer["text"] and r.stdout == answer["text"] + "\n"
    plain = json.loads(run(*common, "--json").stdout)
    r = run(*common)
    assert r.returncode == 0 and r.stdout == tok.decode(tok("w4 w5")["input_ids"] + plain["token_ids"]) + "\n"


def test_serve_bad_port_is_a_clear_error(saved_pair):
    r = run("serve", "--target", str(saved_pair / "target"), "--port", "99999")
    assert r.returncode == 2 and "--port must be in 0..65535" in r.stderr and "Traceback" not in r.stderr


def test_bench_is_offline_before_the_hub_library_loads():
    """`python -m decode bench` set HF_HUB_OFFLINE after transformers had imported huggingface_hub, which reads it
    once: a mistyped --target retried huggingface.co for minutes instead of failing at once."""
    code = ("from decode.__main__ import main\n"
            "try:\n    main(['bench', '--help'])\nexcept SystemExit:\n    pass\n"
            "import huggingface_hub.constants as c\nprint('offline', c.HF_HUB_OFFLINE)")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert "offline True" in r.stdout, r.stdout[-1000:] + r.stderr[-2000:]
