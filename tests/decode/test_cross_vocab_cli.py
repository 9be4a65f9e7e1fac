"""Drafts with their own tokenizer through the command line: ``--draft-tokenizer`` (generate, serve, bench, certify,
vllm-check), the server with such a pair (a real uvicorn on loopback, the real ``openai`` client), the benchmark
with HF universal assisted decoding, and characters per verify step."""
import concurrent.futures as cf
import json
import subprocess
import sys

import httpx
import openai
import pytest

from decode import SpeculativeDecoder
from decode.__main__ import main as decode_main
from decode.bench.cli import run_cli as bench_cli
from decode.loading import load_draft_tokenizer
from decode.metrics import chars_per_verify_step
from decode.serving.cli import _load_and_warm_up, serve_parser
from decode.stops import stop_token_ids
from tests.conftest import tiny_llama
from tests.decode.server_helpers import MODEL, running_server
from tests.decode.test_cross_vocab import TEXTS, byte_level_bpe, metaspace_bpe, transplant

CHAT = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}    return{% endif %}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A target (byte-level BPE, 700 ids, a chat template) and a draft of a metaspace BPE (600 ids) that knows it,
    each saved with its own tokenizer; a prompts file of the test texts."""
    root = tmp_path_factory.mktemp("cross")
    t_tok, d_tok = byte_level_bpe(700), metaspace_bpe(600)
    t_tok.chat_template = CHAT
    target = tiny_llama(vocab_size=len(t_tok), layers=2, seed=0)
    draft = transplant(target, t_tok, d_tok)
    for name, model, tok in (("target", target, t_tok), ("draft", draft, d_tok)):
        model.float().save_pretrained(root / name)
        tok.save_pretrained(root / name)
    d_tok.save_pretrained(root / "draft_tokenizer")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS[:2]))
    return root


def plain_greedy(dec, tok, ids, n):
    plain = SpeculativeDecoder(dec.target, None, 0, tokenizer=tok)
    return plain.generate([ids], max_new_tokens=n, eos_token_id=stop_token_ids(tok, dec.target)).new_tokens[0].tolist()


# ----------------------------------------------------------------------------------------------- --draft-tokenizer

def test_the_draft_tokenizer_is_the_option_else_the_draft_s_own_else_the_target_s(saved, tmp_path):
    t_tok = byte_level_bpe(700)
    own = load_draft_tokenizer(str(saved / "draft"), t_tok)
    assert own.get_vocab() == metaspace_bpe(600).get_vocab()
    given = load_draft_tokenizer(str(saved / "draft"), t_tok, tokenizer_path=str(saved / "target"))
    assert given.get_vocab() == t_tok.get_vocab()
    tiny_llama(vocab_size=600).save_pretrained(tmp_path / "bare")  # no tokenizer of its own: the target's
    assert load_draft_tokenizer(str(tmp_path / "bare"), t_tok) is t_tok
    with pytest.raises(FileNotFoundError, match="draft tokenizer folder .*bare has no tokenizer files"):
        load_draft_tokenizer(str(saved / "draft"), t_tok, tokenizer_path=str(tmp_path / "bare"))


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "certify"])
def test_draft_tokenizer_without_draft_or_a_missing_path_exits_2_before_any_load(saved, tmp_path, capsys, command,
                                                                                 monkeypatch):
    import decode.loading

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(decode.loading, "load_causal_lm", no_load)
    extra = {"generate": ["--prompt", "x"], "serve": ["--port", "0"], "bench": ["--out", str(tmp_path / "b")],
             "certify": []}[command]
    target = ["--target", str(saved / "target")]
    missing = ["--draft", str(saved / "draft"), "--draft-tokenizer", str(tmp_path / "nope")]
    cases = [(missing, "--draft-tokenizer")]
    if command in ("generate", "serve"):  # bench and certify need --draft (argparse exits 2 on its own)
        cases.append((["--draft-tokenizer", str(saved / "draft_tokenizer")], "no --draft was given"))
    for args, words in cases:
        assert decode_main([command, *target, *args, *extra]) == 2
        err = capsys.readouterr().err
        assert words in err and "--draft-tokenizer" in err, err


def test_vllm_check_refuses_a_draft_of_another_vocabulary_with_the_fix(saved, tmp_path):
    done = subprocess.run([sys.executable, "-m", "decode", "vllm-check", "--target", str(saved / "target"),
                           "--draft", str(saved / "draft"), "--vllm-env", str(tmp_path / "env")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "another vocabulary" in done.stderr and "decode bench" in done.stderr
    assert not (tmp_path / "env").exists()


def test_generate_with_the_draft_s_own_tokenizer_equals_plain_greedy(saved, capsys):
    args = ["generate", "--target", str(saved / "target"), "--draft", str(saved / "draft"), "--prompt", TEXTS[0],
            "--max-new-tokens", "12", "-g", "3", "--json", "--device", "cpu"]
    with pytest.warns(UserWarning, match="tokens shared"):
        assert decode_main(args) == 0
    got = json.loads(capsys.readouterr().out)
    assert decode_main(args[:3] + args[5:9] + ["--json", "--device", "cpu"]) == 0  # no --draft: the target alone
    assert got["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
    assert got["alpha"] is not None and got["alpha"] > 0


# ---------------------------------------------------------------------------------------------------------- server

@pytest.fixture(scope="module")
def server(saved):
    args = serve_parser().parse_args(["--target", str(saved / "target"), "--draft", str(saved / "draft"), "-g", "3"])
    with pytest.warns(UserWarning, match="tokens shared"):
        dec, tok, _ = _load_and_warm_up(args, "cpu", False)
    assert dec.intersection is not None  # the draft's own tokenizer was loaded: another vocabulary
    info = {"vocab_intersection": dec.intersection.summary()}  # what `serve` puts in /health
    with running_server(dec, tok, max_batch_size=4, max_queue=16, info=info) as (url, _, _):
        assert "tokens shared" in httpx.get(url + "/health", timeout=10).json()["vocab_intersection"]
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), dec, tok


def test_server_completions_and_chat_equal_plain_greedy(server):
    client, dec, tok = server
    ids = tok(TEXTS[0])["input_ids"]
    new = plain_greedy(dec, tok, ids, 16)
    r = client.completions.create(model=MODEL, prompt=TEXTS[0], max_tokens=16, temperature=0)
    assert r.choices[0].text == tok.decode(new, skip_special_tokens=True) and r.usage.completion_tokens == len(new)
    messages = [{"role": "user", "content": TEXTS[2]}]
    chat_ids = tok(TEXTS[2] + "\n    return")["input_ids"]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == tok.decode(plain_greedy(dec, tok, chat_ids, 12), skip_special_tokens=True)


def test_server_batch_of_four_equals_plain_greedy_and_stop_strings_cut(server):
    client, dec, tok = server
    expected = [tok.decode(plain_greedy(dec, tok, tok(t)["input_ids"], 20), skip_special_tokens=True) for t in TEXTS]
    with cf.ThreadPoolExecutor(4) as pool:  # four requests decoded together
        got = list(pool.map(lambda t: client.completions.create(model=MODEL, prompt=t, max_tokens=20, temperature=0)
                            .choices[0].text, TEXTS))
    assert got == expected
    text = expected[1]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    r = client.completions.create(model=MODEL, prompt=TEXTS[1], max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].text == text[: text.find(stop)] and r.choices[0].finish_reason == "stop"


def test_server_samples_with_a_seed_the_same_alone_and_in_a_batch(server):
    client, dec, tok = server
    ask = dict(model=MODEL, prompt=TEXTS[3], max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    alone = client.completions.create(**ask).choices[0].text
    with cf.ThreadPoolExecutor(3) as pool:
        busy = [pool.submit(client.completions.create, **{**ask, "prompt": t, "seed": 1}) for t in TEXTS[:2]]
        again = pool.submit(client.completions.create, **ask).result().choices[0].text
        [f.result() for f in busy]
    assert again == alone


# ----------------------------------------------------------------------------------------------------------- bench

def test_chars_per_verify_step_is_text_per_token_times_tau():
    assert chars_per_verify_step(30, 10, 2.5) == 7.5
    assert chars_per_verify_step(30, 0, 2.5) is None and chars_per_verify_step(30, 10, None) is None


def test_bench_runs_a_pair_of_two_tokenizers_with_hf_universal_assisted_decoding(saved, tmp_path):
    out = tmp_path / "bench.json"
    with pytest.warns(UserWarning, match="tokens shared"):
        results = bench_cli(["--target", str(saved / "target"), "--draft", str(saved / "draft"), "--prompts",
                             str(saved / "prompts.jsonl"), "--limit", "2", "--max-new-tokens", "8", "--gammas", "2",
                             "--no-auto", "--temperatures", "0,1", "--batch-sizes", "1", "--cost-repeats", "3",
                             "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--out", str(out)])
    assert results["config"]["cross_vocab"] is True
    runs = {(r["temperature"], r["method"]): r["overall"] for r in results["runs"]}
    assert set(runs) == {(t, m) for t in (0.0, 1.0) for m in ("plain", "spec_g2", "hf_target", "hf_assisted")}
    for method in ("spec_g2", "hf_assisted", "hf_target"):  # lossless at T = 0, ours and HF's
        assert runs[(0.0, method)]["matches_plain_greedy"] == 1.0, method
    records = results["records"]
    for t in ("0.0", "1.0"):
        recs = records[f"{t}/spec_g2"]
        tokenizer = byte_level_bpe(700)
        chars = sum(len(tokenizer.decode(r["new_tokens"], skip_special_tokens=True)) for r in recs)
        m = runs[(float(t), "spec_g2")]
        assert m["chars_per_token"] == chars / m["num_new_tokens"]
        assert m["chars_per_verify_step"] == pytest.approx(m["chars_per_token"] * m["mean_accepted_length"])
        assert runs[(float(t), "hf_assisted")]["chars_per_verify_step"] is None  # HF reports no τ
    assert json.loads(out.read_text())["runs"][1]["overall"]["chars_per_verify_step"] is not None



def test_certify_passes_the_pair_from_the_command_line(saved, tmp_path):
    """``decode certify`` on the saved pair: the draft's own tokenizer (another vocabulary) is picked up, and the
    draws pass against the target's exact distributions at T = 1 and under top-k."""
    from decode.certify import main as certify_main

    out = tmp_path / "cert.json"
    code = certify_main(["--target", str(saved / "target"), "--draft", str(saved / "draft"), "--prompts",
                         str(saved / "prompts.jsonl"), "-M", "2", "-K", "300", "--prefix-tokens", "4", "--settings",
                         "T=1; T=0.8,top_k=5", "--out", str(out)])
    cert = json.loads(out.read_text())
    assert code == 0 and cert["verdict"] == "PASS", cert["verdict"]
    assert cert["samples_per_prefix"] == 300 and len(cert["prefix_lengths"]) == 2
