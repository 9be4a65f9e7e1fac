"""distill.corpus: deterministic disjoint splits of real corpora, and held-out prompt sets."""
from __future__ import annotations

import pytest

from distill import corpus
from decode.prompts import mbpp_to_prompt
from distill.corpus import SPLITS, load_corpus, load_prompts, split_of, stdlib_files, stdlib_prompt


@pytest.fixture
def fake_stdlib(tmp_path):
    """A small stdlib-shaped tree: 60 modules, plus folders that must be skipped."""
    for i in range(60):
        sub = tmp_path / ("pkg" if i % 3 == 0 else "")
        sub.mkdir(exist_ok=True)
        (sub / f"mod{i}.py").write_text(f'"""Module {i}."""\nimport os\n\ndef f{i}(x):\n    return x + {i}\n')
    for skipped in ("test", "site-packages", "encodings", "pkg/tests", "__pycache__"):
        (tmp_path / skipped).mkdir(parents=True, exist_ok=True)
        (tmp_path / skipped / "skipme.py").write_text("SKIP = 1\n")
    (tmp_path / "notes.txt").write_text("not python")
    (tmp_path / "empty.py").write_text("   \n")
    return tmp_path


def test_split_of_is_deterministic_and_roughly_proportional():
    keys = [f"a/b{i}.py" for i in range(4000)]
    first = [split_of(k) for k in keys]
    assert first == [split_of(k) for k in keys]
    counts = {s: first.count(s) for s in SPLITS}
    assert 0.87 < counts["train"] / len(keys) < 0.93
    assert 0.03 < counts["validation"] / len(keys) < 0.07
    assert 0.03 < counts["test"] / len(keys) < 0.07
    # the fractions are respected when changed
    assert all(split_of(k, (1.0, 0.0)) == "train" for k in keys[:100])


def test_stdlib_files_skip_tests_and_generated_tables(fake_stdlib):
    rels = [rel for rel, _ in stdlib_files(fake_stdlib)]
    assert len([r for r in rels if r.endswith(".py") and "mod" in r]) == 60
    assert not any("skipme" in r for r in rels)
    assert len(set(rels)) == len(rels)


def test_stdlib_splits_are_disjoint_and_cover_every_nonempty_file(fake_stdlib):
    parts = {s: load_corpus("stdlib", s, root=fake_stdlib, fractions=(0.6, 0.2)) for s in SPLITS}
    paths = {s: set(parts[s]["path"]) for s in SPLITS}
    assert not (paths["train"] & paths["validation"]) and not (paths["train"] & paths["test"])
    assert not (paths["validation"] & paths["test"])
    assert sum(len(p) for p in paths.values()) == 60  # empty.py dropped
    assert set(parts["train"].column_names) == {"text", "path"}
    row = parts["train"][0]
    assert row["text"] == (fake_stdlib / row["path"]).read_text()


def test_real_stdlib_is_read_and_split():
    train = load_corpus("stdlib", "train", max_items=5)
    assert len(train) == 5 and all(split_of(p) == "train" for p in train["path"])
    assert not any(p.startswith(("test/", "site-packages/")) for p in train["path"])


@pytest.mark.parametrize("name", ["tinystories", "tinyshakespeare"])
def test_shared_text_corpora_split_deterministically(name):
    val = load_corpus(name, "validation")
    test = load_corpus(name, "test")
    assert len(val) > 10 and len(test) > 10
    assert not set(val["text"]) & set(test["text"])
    assert list(load_corpus(name, "validation")["text"]) == list(val["text"])


def test_bad_names_raise_with_the_choices(fake_stdlib):
    with pytest.raises(ValueError, match="unknown corpus 'nope'.*stdlib"):
        load_corpus("nope", "train")
    with pytest.raises(ValueError, match="unknown split 'dev'.*validation"):
        load_corpus("stdlib", "dev")
    with pytest.raises(ValueError, match="empty"):
        load_corpus("stdlib", "test", root=fake_stdlib, fractions=(1.0, 0.0))
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompts("gsm9k")


def test_missing_shared_data_names_the_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTKIT_SHARED_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="DRAFTKIT_SHARED_DATA"):
        load_corpus("tinystories", "train")


def test_mbpp_prompt_uses_the_tested_functions_def_line():
    task = {"text": "Write a  function to add.", "code": "import math\r\ndef helper(a):\r\n  return a\r\n"
            "def add(a, b): \r\n  return helper(a) + b",
            "test_list": ["assert add(1, 2) == 3"]}
    prompt = mbpp_to_prompt(task["text"], task["code"], task["test_list"])
    assert prompt == 'def add(a, b):\n    """Write a function to add.\n    """\n'
    assert mbpp_to_prompt("Do it.", "x = 1", []) == '"""Do it."""\ndef'


def test_stdlib_prompt_ends_after_the_first_def_line():
    text = "'''doc'''\nimport os\n" + "X = 1\n" * 200 + "class A:\n    def m(self, x):\n        return x\n"
    p = stdlib_prompt(text, max_chars=100)
    assert p.endswith("    def m(self, x):\n") and len(p) <= 100 and p.startswith("X = 1\n")
    assert stdlib_prompt("x = 1\n") is None


def test_real_prompt_sets():
    he = load_prompts("humaneval", 3)
    assert len(he) == 3 and he[0].rstrip().endswith('"""') and "def " in he[0]
    mb = load_prompts("mbpp_code")
    assert len(mb) == 974 and all(p.startswith(("def ", '"""')) for p in mb)
    from decode import prompts as dprompts

    # one name, one prompt set: "mbpp" is the task text here and in the benchmark alike
    assert load_prompts("mbpp", 5) == [p.text for p in dprompts.load_prompts("mbpp", limit=5)]
    assert mb[:5] == [p.text for p in dprompts.load_prompts("mbpp_code", limit=5)]
    st = load_prompts("stdlib", 4)
    held_out = set(load_corpus("stdlib", "test")["text"])
    assert len(st) == 4 and all(any(p in t for t in held_out) for p in st)
    assert {"humaneval", "mbpp", "mbpp_code", "stdlib"} <= set(corpus.PROMPT_SETS)
