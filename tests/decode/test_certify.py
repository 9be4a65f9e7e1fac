"""``decode certify``: the statistics are right, the certificate passes the real decoder and fails a biased
acceptance rule by a wide margin, and the command line checks its input before loading anything.

The biased rule is injected by replacing the function object ``decode.verify.verify`` wherever a loaded ``decode``
module holds it (the engine binds it at import with ``from decode.verify import verify``), so the hook does not
depend on which engine module calls it or under which name."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import decode.certify as certify_cli
import decode.engine  # noqa: F401  (loaded so its binding of verify is patched too)
import decode.verify
from decode import SpeculativeDecoder
from decode.certify import (Setting, _summarise, bhc_radius, certify, chi_square_test,
                            detectable_tv, draw_two_tokens, format_certificate, holm, max_prefix_length,
                            parse_settings, pooled_cells)
from decode.loading import check_model_path
from decode.sampling import logits_to_probs
from tests.conftest import make_tokenizer, perturbed_copy, tiny_llama

V = 8
PREFIXES = [[1, 5, 3, 6], [4, 4, 2]]


def small_vocab_llama(seed, layers):
    model = tiny_llama(vocab_size=V, seed=seed, layers=layers)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # keep mass on many ids, so the draft and target disagree often
    return model


@pytest.fixture(scope="module")
def pair():
    return small_vocab_llama(seed=0, layers=2), small_vocab_llama(seed=7, layers=1)


_REAL_VERIFY = decode.verify.verify


def biased_verify(draft_probs, target_probs, draft_tokens, generator=None, *, accept_u=None, **kwargs):
    """The acceptance rule with a deliberate bias: accept when u < p/q + 0.1, i.e. the real rule fed u − 0.1
    (residual and bonus draws unchanged). Takes the engine's keyword arguments (accept_u, sample_u, num_draft)."""
    B, gamma, _ = draft_probs.shape
    if accept_u is None:
        accept_u = torch.rand((B, gamma), generator=generator, device=draft_probs.device, dtype=torch.float32)
    return _REAL_VERIFY(draft_probs, target_probs, draft_tokens, generator, accept_u=accept_u - 0.1, **kwargs)


def patch_acceptance_rule(monkeypatch, fn):
    """Replace ``decode.verify.verify`` in every loaded decode module that holds it; returns the names patched."""
    original = decode.verify.verify
    patched = []
    for name, module in list(sys.modules.items()):
        if name == "decode" or name.startswith("decode."):
            for attr, value in list(vars(module).items()):
                if value is original:
                    monkeypatch.setattr(module, attr, fn)
                    patched.append(f"{name}.{attr}")
    return patched


# -------------------------------------------------------------------------------- the certificate has power
SETTINGS = [Setting(1.0), Setting(0.7, top_p=0.9)]


def test_correct_decoder_passes(pair):
    target, draft = pair
    cert = certify(target, draft, PREFIXES, SETTINGS, samples=4000, num_draft_tokens=2, alpha=0.01, seed=0)
    assert cert["passed"], format_certificate(cert)
    assert all(t["impossible"] == 0 for t in cert["tests"])
    assert len(cert["tests"]) == 2 * (2 * 3 + 3)  # settings x (prefixes x tests + combined)
    for s in cert["settings"]:
        assert s["draws"] == 8000
        t1 = s["token1"]
        assert 0 < t1["max_tv_observed"] < t1["max_tv_upper"] < 0.1  # the bound is informative at K = 4000
        assert 0 < t1["combined_detectable_tv"] < t1["median_detectable_tv"] < 0.06
    json.dumps(cert)  # JSON-ready


def test_biased_acceptance_rule_fails_by_a_wide_margin(pair, monkeypatch):
    target, draft = pair
    dec = SpeculativeDecoder(target, draft, 2)
    g = torch.Generator().manual_seed(5)
    honest = dec.generate([PREFIXES[0]] * 2000, max_new_tokens=3, temperature=1.0, generator=g).stats.acceptance_rate
    patched = patch_acceptance_rule(monkeypatch, biased_verify)
    assert "decode.verify.verify" in patched and len(patched) >= 2, patched  # the engine's binding too
    biased = dec.generate([PREFIXES[0]] * 2000, max_new_tokens=3, temperature=1.0, generator=g).stats.acceptance_rate
    assert biased > honest + 0.03  # the hook reached the engine

    cert = certify(target, draft, PREFIXES, SETTINGS, samples=8000, num_draft_tokens=2, alpha=0.01, seed=0)
    assert not cert["passed"]
    t1 = next(s for s in cert["settings"] if s["setting"] == "T=1")
    # At T=1 every id is possible, so the failure comes from the chi-square tests themselves, far below alpha.
    assert all(t["impossible"] == 0 for t in cert["tests"] if t["setting"] == "T=1")
    assert t1["min_p_holm"] < 1e-8 and not t1["passed"]
    assert min(t["p_value"] for t in cert["tests"] if t["setting"] == "T=1" and t["test"] == "token2") < 1e-4


def test_rows_of_one_batch_are_independent(pair):
    """The certificate treats the K rows of one generate call as independent draws: adjacent rows' first tokens
    must follow p x p (and a batch whose rows are copies must fail the same check)."""
    target, draft = pair
    K = 8000
    dec = SpeculativeDecoder(target, draft, 2)
    out = dec.generate([PREFIXES[0]] * K, max_new_tokens=3, temperature=1.0, generator=torch.Generator().manual_seed(3))
    x1 = np.array([int(t[0]) for t in out.new_tokens])
    with torch.no_grad():
        p = logits_to_probs(target(torch.tensor([PREFIXES[0]])).logits[0, -1], 1.0).double().numpy()
    pair_p = np.outer(p, p).reshape(-1)

    def p_value(first, second):
        cells = pooled_cells(pair_p, first * V + second, len(first))
        return chi_square_test(cells[0], cells[1], cells[3])[2]

    assert p_value(x1[0::2], x1[1::2]) > 1e-3
    assert p_value(x1[0::2], x1[0::2]) < 1e-8  # perfectly dependent rows are caught


# -------------------------------------------------------------------------------- the statistics
def test_pooled_cells_pools_light_outcomes_and_counts_impossible_draws():
    probs = np.array([0.5, 0.3, 0.15, 0.04, 0.01, 0.0])
    observed = np.array([0] * 50 + [1] * 30 + [2] * 15 + [3] * 3 + [4] * 1 + [5] * 1)
    cp, cn, resolved, impossible = pooled_cells(probs, observed, 100)
    # Expected counts 50, 30, 15 stand alone; 4 + 1 + 0 = 5 pool into one cell.
    np.testing.assert_allclose(cp, [0.5, 0.3, 0.15, 0.05])
    np.testing.assert_array_equal(cn, [50, 30, 15, 5])
    assert resolved.tolist() == [True, True, True, False] and impossible == 1
    assert chi_square_test(cp, cn, impossible)[2] == 0.0  # a probability-0 draw fails outright
    # A pool below 5 is merged into the smallest cell; draws outside the enumeration (-1) land in the pool.
    cp, cn, resolved, _ = pooled_cells(np.array([0.6, 0.37]), np.array([0] * 60 + [1] * 36 + [-1] * 4), 100)
    np.testing.assert_allclose(cp, [0.6, 0.4])
    np.testing.assert_array_equal(cn, [60, 40])
    assert resolved.tolist() == [True, False]
    # Greedy: one cell of probability 1 is an exact check (df = 0).
    cp, cn, _, imp = pooled_cells(np.array([0.0, 1.0, 0.0]), np.ones(10, dtype=np.int64), 10)
    assert chi_square_test(cp, cn, imp)[1:] == (0, 1.0)
    cp, cn, _, imp = pooled_cells(np.array([0.0, 1.0, 0.0]), np.array([1] * 9 + [2]), 10)
    assert chi_square_test(cp, cn, imp)[2] == 0.0


def test_chi_square_p_values_are_uniform_under_the_null():
    """Under H0 the p-value is about uniform: the share below 0.05 is near 0.05 (and pooling does not break it)."""
    rng = np.random.default_rng(0)
    probs = np.array([0.4, 0.2, 0.15, 0.1, 0.06, 0.04, 0.03, 0.01, 0.005, 0.005])
    pv = []
    for _ in range(2000):
        obs = rng.choice(len(probs), size=300, p=probs)
        cp, cn, _, imp = pooled_cells(probs, obs, 300)
        pv.append(chi_square_test(cp, cn, imp)[2])
    share = np.mean(np.array(pv) < 0.05)
    assert 0.035 < share < 0.065, share


def test_holm_matches_its_definition():
    p = [0.01, 0.04, 0.03, 0.005]
    # sorted: 0.005*4=0.02, 0.01*3=0.03, 0.03*2=0.06, 0.04*1=0.04 -> running max 0.02, 0.03, 0.06, 0.06
    np.testing.assert_allclose(holm(p), [0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]).tolist() == [1.0, 1.0]


def test_bhc_radius_covers_the_empirical_tv_and_is_not_vacuous():
    rng = np.random.default_rng(1)
    probs = np.array([0.35, 0.25, 0.2, 0.1, 0.06, 0.04])
    K, delta = 500, 0.1
    eps = bhc_radius(len(probs), K, delta)
    tv = np.array([0.5 * np.abs(rng.multinomial(K, probs) / K - probs).sum() for _ in range(2000)])
    assert np.mean(tv >= eps) <= delta
    assert eps < 3 * tv.max()


def test_detectable_tv_has_the_stated_power():
    """An alternative with exactly the reported TV is detected in about 80% of runs (at least 75%)."""
    from scipy.stats import chi2

    rng = np.random.default_rng(2)
    p = np.full(4, 0.25)
    K, level = 2000, 1e-3
    d = detectable_tv(3, K, level)
    # The worst case of chi2-divergence >= 4 TV^2 is a two-valued shift: +d on half the mass, -d on the other.
    q = p + np.array([d, d, -d, -d]) / 2
    assert math.isclose(0.5 * np.abs(q - p).sum(), d)
    hits = [chi2.sf((((rng.multinomial(K, q) - K * p) ** 2) / (K * p)).sum(), 3) < level for _ in range(1000)]
    assert np.mean(hits) >= 0.75
    assert detectable_tv(0, K, level) is None


# -------------------------------------------------------------------------------- settings and command line
def test_parse_settings():
    s = parse_settings("T=1; T=0.7,top_p=0.9; temperature=0.7, top_k=20 ;T=0")
    assert s == [Setting(1.0), Setting(0.7, top_p=0.9), Setting(0.7, top_k=20), Setting(0.0)]
    assert [x.label for x in s] == ["T=1", "T=0.7,top_p=0.9", "T=0.7,top_k=20", "T=0"]


@pytest.mark.parametrize("text,needle", [
    ("T=1; T=0.7,top_q=0.9", "part 2 ('T=0.7,top_q=0.9'): unknown key 'top_q'"),
    ("T=1;", "part 2 is empty"),
    ("top_k=20", "part 1 ('top_k=20'): no temperature"),
    ("T=1; T=0.7,top_k=2.5", "part 2 ('T=0.7,top_k=2.5'): top_k='2.5' is not an integer"),
    ("T=-1", "part 1 ('T=-1'): temperature must be"),
    ("T=1,T=2", "'T' given twice"),
    ("T=1; T=0.7 top_p=0.9", "part 2"),
    ("T=1; T=0.7,top_p=1.5", "part 2 ('T=0.7,top_p=1.5'): top_p must be"),
    ("T=1; temperature=1.0", "part 2 ('temperature=1.0') repeats part 1 ('T=1'): both are T=1"),
    ("T=0.7,top_k=20; T=1; top_k=20,T=0.70", "part 3 ('top_k=20,T=0.70') repeats part 1"),
    ("T=0.7; T=0.7,top_p=1.0", "part 2 ('T=0.7,top_p=1.0') samples the same distribution as part 1"),
    ("T=0; T=0,top_k=5", "part 2 ('T=0,top_k=5') samples the same distribution as part 1"),
])
def test_parse_settings_errors_name_the_part(text, needle):
    with pytest.raises(ValueError) as err:
        parse_settings(text)
    assert needle in str(err.value)


def run_cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "decode", "certify", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved target/draft pair (context 256) with its tokenizer, and a prompt file of two short prompts."""
    path = tmp_path_factory.mktemp("certify")
    tok = make_tokenizer()
    target = tiny_llama(seed=0).float()
    with torch.no_grad():
        target.lm_head.weight.mul_(0.1)  # the fixture's sharpening would leave one likely id per prefix
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.5, seed=1))):
        model.save_pretrained(path / name)
        tok.save_pretrained(path / name)
    prompts = path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("w1 w2 w3 w4", "w9 w8 w7")) + "\n")
    return path


def pair_args(saved):
    return ["--target", str(saved / "target"), "--draft", str(saved / "draft"), "--prompts",
            str(saved / "prompts.jsonl")]


def test_cli_writes_a_certificate_and_never_overwrites(saved, tmp_path):
    out = tmp_path / "cert.json"
    common = pair_args(saved)
    r = run_cli(*common, "-M", "2", "-K", "300", "--prefix-tokens", "3", "--settings", "T=1; T=0.8,top_k=5",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "certificate: PASS" in r.stdout and "T=0.8,top_k=5" in r.stdout
    cert = json.loads(out.read_text())
    assert cert["passed"] and cert["num_prefixes"] == 2 and cert["samples_per_prefix"] == 300
    assert cert["prefix_lengths"] == [3, 3]  # the last 3 tokens of each prompt
    assert len(cert["tests"]) == 2 * (2 * 3 + 3)

    # An existing --out is refused before any model loads (the target path does not even exist here).
    before = out.read_text()
    r = run_cli("--target", str(tmp_path / "missing"), "--draft", str(saved / "draft"), "--out", str(out))
    assert r.returncode == 2 and "--out" in r.stderr and "--overwrite" in r.stderr
    assert out.read_text() == before
    r = run_cli(*common, "--settings", "T=1; T=0.7,top_q=0.9")
    assert r.returncode == 2 and "part 2" in r.stderr and "top_q" in r.stderr
    r = run_cli(*common, "--num-draft-tokens", "1")
    assert r.returncode == 2 and "--num-draft-tokens must be >= 2" in r.stderr


# -------------------------------------------------------------------------------- power, exactness, verdicts
def test_a_setting_without_power_makes_the_run_inconclusive_and_greedy_tests_are_exact(pair):
    """Found by a new user: at K = 1 every test is one pooled cell (df = 0), yet the run said PASS and printed
    "exact". Now T=1 has no power (INCONCLUSIVE, pointing at -K) while T=0 is exact: its only outcome has
    probability 1, so the first draw elsewhere would fail it."""
    target, draft = pair
    cert = certify(target, draft, PREFIXES, [Setting(1.0), Setting(0.0)], samples=1, num_draft_tokens=2, seed=0)
    assert cert["verdict"] == "INCONCLUSIVE" and not cert["passed"]
    t1, t0 = cert["settings"]
    assert t1["verdict"] == "no power" and not t1["passed"] and t0["verdict"] == "pass"
    for name in ("token1", "token2", "joint"):
        assert t1[name]["median_detectable_tv"] is None and t1[name]["combined_detectable_tv"] is None
        assert t1[name]["no_power_prefixes"] == 2 and t1[name]["exact_prefixes"] == 0
        assert t0[name]["exact_prefixes"] == 2 and t0[name]["no_power_prefixes"] == 0
        assert math.isclose(t0[name]["median_detectable_tv"], 0.8)  # 1 - (1 - d)^1 = 0.8
        assert math.isclose(t0[name]["combined_detectable_tv"], 1 - 0.2 ** 0.5)  # two prefixes: K = 2 draws
    text = format_certificate(cert)
    assert text.startswith("speculative decoding certificate: INCONCLUSIVE")
    assert "INCONCLUSIVE: no test of T=1 has any power" in text and "raise --samples/-K" in text
    rows = [line for line in text.splitlines() if {"token1", "token2", "joint"} & set(line.split())]
    assert len(rows) == 6 and all("no power" in r for r in rows[:3]) and not any("no power" in r for r in rows[3:])


def test_greedy_certificate_passes_with_exact_tests(pair):
    target, draft = pair
    cert = certify(target, draft, PREFIXES, [Setting(0.0)], samples=50, num_draft_tokens=2, seed=0)
    assert cert["verdict"] == "PASS" and cert["passed"]
    assert all(t["exact"] and t["df"] == 0 and t["impossible"] == 0 for t in cert["tests"])
    for t in cert["tests"]:
        K = 50 if t["prefix"] is not None else 100
        assert math.isclose(t["detectable_tv"], 1 - 0.2 ** (1 / K))
    assert detectable_tv(0, 50, 1e-3, exact=True) < 0.04  # 50 draws miss a mass of 0.04 with probability < 0.2


def test_summary_median_counts_prefixes_without_power():
    """The median detectable TV used to leave out prefixes whose test had df = 0, overstating the power."""
    def result(prefix, test, d, df=1):
        return certify_cli.TestResult("T=1", prefix, test, 10, 2, df, 0.0, 1.0, tv_observed=0.0, tv_upper=0.5,
                                      pooled_mass=0.0, detectable_tv=d, p_holm=1.0)

    per_test = {"token1": [0.1, None, None], "token2": [0.1, 0.2, None], "joint": [0.1, 0.1, 0.1]}
    results = [result(m, name, d, 0 if d is None else 1) for name, ds in per_test.items() for m, d in enumerate(ds)]
    results += [result(None, name, 0.05) for name in per_test]
    cert = _summarise(results, [Setting(1.0)], [[1], [2], [3]], 10, 2, 0.01, 0, 128, 0.0)
    s = cert["settings"][0]
    assert s["token1"]["median_detectable_tv"] is None and s["token1"]["no_power_prefixes"] == 2
    assert s["token2"]["median_detectable_tv"] == 0.2 and s["token2"]["no_power_prefixes"] == 1
    assert s["joint"]["median_detectable_tv"] == 0.1 and s["joint"]["no_power_prefixes"] == 0
    assert cert["verdict"] == "PASS"  # the setting has power somewhere
    assert " 2/3" in format_certificate(cert)


# -------------------------------------------------------------------------------- input checks
def test_duplicate_settings_are_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="settings repeat T=1"):
        certify(target, draft, PREFIXES, [Setting(1.0), Setting(temperature=1.0)], samples=10)


def test_a_prefix_must_leave_room_for_the_draws():
    """Found by a new user: a prefix that fills the context ran into a RuntimeError after sampling (exit 1)."""
    target = small_vocab_llama(seed=0, layers=1)
    target.config.max_position_embeddings = 16
    draft = small_vocab_llama(seed=7, layers=1)
    draft.config.max_position_embeddings = 15
    limit, reason = max_prefix_length(target, draft, 2)
    assert limit == 12 and "(16)" in reason and "(15)" in reason  # min(16 - 4, 15 - 3): the prefill's token, γ
    assert max_prefix_length(target, draft, 3)[0] == 11
    cert = certify(target, draft, [[3] * 12], [Setting(1.0)], samples=20, num_draft_tokens=2)  # the longest works
    assert cert["prefix_lengths"] == [12]
    with pytest.raises(ValueError, match=r"prefix 0 has 13 tokens, more than 12: the prefix and its γ \+ 2 = 4"):
        certify(target, draft, [[3] * 13], [Setting(1.0)], samples=20, num_draft_tokens=2)


def test_cli_prefix_tokens_over_the_context_exits_2_before_sampling(saved, tmp_path, capsys, monkeypatch):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(f"w{i % 90}" for i in range(300))}) + "\n")
    monkeypatch.setattr(certify_cli, "certify", lambda *a, **k: pytest.fail("sampled"))
    args = pair_args(saved)[:4] + ["--prompts", str(prompts), "-M", "1", "-K", "5", "--settings", "T=1"]
    assert certify_cli.main([*args, "--prefix-tokens", "253"]) == 2
    err = capsys.readouterr().err
    assert "--prefix-tokens 253 is more than 252" in err and "use --prefix-tokens <= 252" in err
    assert certify_cli.main([*args, "--prefix-tokens", "40", "-g", "300"]) == 2
    err = capsys.readouterr().err  # it said "--prefix-tokens 40 is more than -45"
    assert "--num-draft-tokens 300 leaves no room for a prefix" in err and "lower --num-draft-tokens" in err


def test_cli_overwrite_without_out_is_refused(saved, capsys, monkeypatch):
    """--overwrite without --out was accepted silently (nothing is written without --out)."""
    monkeypatch.setattr(certify_cli, "certify", lambda *a, **k: pytest.fail("sampled"))
    assert certify_cli.main([*pair_args(saved)[:4], "-M", "1", "-K", "5", "--settings", "T=1", "--overwrite"]) == 2
    assert "--overwrite replaces an existing --out file, and no --out was given" in capsys.readouterr().err


def test_cli_says_when_the_prompts_hold_fewer_prefixes_than_asked(saved, tmp_path, capsys, monkeypatch):
    """-M above the prompt set's size ran fewer prefixes with only the certificate's num_prefixes saying so."""
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"w{i} w5 w7"}) + "\n" for i in range(2)))
    seen = []

    def count(target, draft, prefixes, *args, **kwargs):  # stop after counting: sampling is tested elsewhere
        seen.append(len(prefixes))
        raise ValueError("counted")

    monkeypatch.setattr(certify_cli, "certify", count)
    args = pair_args(saved)[:4] + ["--prompts", str(prompts), "-K", "5", "--settings", "T=1"]
    assert certify_cli.main([*args, "-M", "5"]) == 2 and seen == [2]
    assert f"--prompts {prompts} has 2 prompt(s), fewer than --num-prefixes 5; certifying 2" in capsys.readouterr().err
    assert certify_cli.main([*args, "-M", "2"]) == 2 and seen == [2, 2]
    assert "fewer than --num-prefixes" not in capsys.readouterr().err


def test_cli_paths_are_checked_before_loading(saved, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for argv, needle in [
        ([*pair_args(saved), "--out", str(afile / "cert.json")], f"'{afile}' is a file, not a folder"),
        ([*pair_args(saved), "--out", str(afile / "sub" / "cert.json")], "is a file, not a folder"),
        (["--target", str(tmp_path / "nonexistent"), "--draft", str(saved / "draft")],
         f"--target path '{tmp_path / 'nonexistent'}' does not exist"),
        (["--target", str(saved / "target"), "--draft", str(afile)], "--draft path"),
        ([*pair_args(saved), "--tokenizer", "./nosuch"], "--tokenizer path './nosuch' ("),
        ([*pair_args(saved), "--settings", "T=1; temperature=1.0"], "repeats part 1"),
    ]:
        assert certify_cli.main(argv) == 2, argv
        assert needle in capsys.readouterr().err, argv
    check_model_path("someorg/somemodel", "--target")  # a hub id is left to the loader


def test_out_uses_a_unique_temporary_file_and_keeps_a_file_made_during_the_run(saved, tmp_path, capsys,
                                                                                monkeypatch):
    """Found by a new user: --out wrote <out>.tmp (replacing a user's file of that name), and when <out> appeared
    during the run the certificate was left in that .tmp."""
    out = tmp_path / "cert.json"
    users = tmp_path / "cert.json.tmp"
    users.write_text("the user's own file")
    args = [*pair_args(saved), "-M", "1", "-K", "30", "--prefix-tokens", "3", "--settings", "T=0", "--out", str(out)]
    assert certify_cli.main(args) == 0
    assert json.loads(out.read_text())["verdict"] == "PASS"
    assert users.read_text() == "the user's own file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cert.json", "cert.json.tmp"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())

    out.unlink()
    real = certify_cli.certify

    def someone_writes_out(*a, **k):
        out.write_text("written meanwhile")
        return real(*a, **k)

    monkeypatch.setattr(certify_cli, "certify", someone_writes_out)
    assert certify_cli.main(args) == 4
    err = capsys.readouterr().err
    assert "appeared during the run and was kept" in err
    assert out.read_text() == "written meanwhile" and users.read_text() == "the user's own file"
    (kept,) = [p for p in tmp_path.iterdir() if p.name not in ("cert.json", "cert.json.tmp")]
    assert str(kept) in err and kept.suffix == ".json" and json.loads(kept.read_text())["verdict"] == "PASS"


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_draws_come_in_bounded_batches():
    class Recorder:
        sizes = []

        def generate(self, ids, max_new_tokens, generator, num_draft_tokens, **sampling):
            self.sizes.append(len(ids))
            return type("Out", (), {"new_tokens": [torch.tensor([5, 6, 7])] * len(ids)})()

    rec = Recorder()
    draws = draw_two_tokens(rec, [1, 2], 7, Setting(1.0), 2, torch.Generator(), "cpu", batch_size=3)
    assert rec.sizes == [3, 3, 1] and draws.shape == (7, 2) and (draws == [5, 6]).all()


def test_cli_an_unexpected_error_is_not_reported_as_fail(saved, capsys, monkeypatch):
    """An uncaught exception exits 1, the FAIL code: a script would read a crash as "not lossless"."""
    def crash(*a, **k):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(certify_cli, "certify", crash)
    args = pair_args(saved)[:4] + ["-M", "1", "-K", "5", "--settings", "T=1"]
    assert certify_cli.main(args) == certify_cli.EXIT_NO_VERDICT == 5
    err = capsys.readouterr().err
    assert "certify stopped before a verdict (RuntimeError: out of memory)" in err and "Traceback" in err
    monkeypatch.setattr(certify_cli, "certify", lambda *a, **k: (_ for _ in ()).throw(ValueError("bad pair")))
    assert certify_cli.main(args) == 2 and "error: bad pair" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,error,needle", [
    (dict(prefixes=[5, 6, 7]), ValueError, "prefixes must be a list of token-id lists"),
    (dict(prefixes=5), ValueError, "prefixes must be a list of token-id lists"),
    (dict(settings=1.0), ValueError, "settings must be a list of Setting"),
    (dict(settings="T=1"), ValueError, r"settings must be a list of Setting \(e.g. parse_settings"),
    (dict(settings=[{"temperature": 1.0}]), ValueError, "settings must be a list of Setting"),
    (dict(samples="10"), ValueError, "samples must be an integer >= 1"),
    (dict(draft=None), ValueError, "certify needs a draft"),
    (dict(tokenizer="tok"), TypeError, "tokenizer must be a tokenizer object"),
    (dict(target="/path/to/target"), TypeError, "target must be a loaded Hugging Face causal LM"),
])
def test_bad_arguments_are_refused_by_name(pair, kwargs, error, needle):
    target, draft = pair
    args = dict(target=target, draft=draft, prefixes=[[5, 6]], settings=parse_settings("T=1"), samples=10)
    with pytest.raises(error, match=needle):
        certify(**{**args, **kwargs})


def test_a_2d_tensor_of_prefixes_is_one_prefix_per_row(pair):
    target, draft = pair
    out = certify(target, draft, torch.tensor([[5, 6], [7, 1]]), parse_settings("T=0"), samples=4)
    assert out["settings"][0]["prefixes"] == 2
