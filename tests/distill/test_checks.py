"""Pre-flight checks against the disk: model folders, corpus files, a data source's fields read as training will,
all before anything loads."""
import re

import pytest

from distill.checks import check_inputs, normalize_config, preflight_source
from distill.config import SetupError, compose
from distill_helpers import source


def test_parquet_and_csv_fields_are_checked_before_loading(tmp_path):
    """A missing field or an empty cell in parquet/csv was found only after the models loaded, with a message
    that named no setting ("set the *_field key")."""
    import datasets

    pq, csv = tmp_path / "p.parquet", tmp_path / "c.csv"
    datasets.Dataset.from_dict({"q": ["a b", "c d"], "a": [" x", " y"]}).to_parquet(str(pq))
    csv.write_text("q,a\na b, x\nc d,\n")
    with pytest.raises(SetupError, match=r"p.parquet, row 1: field 'question' not found .*set data.source.prompt_field"):
        preflight_source(source(path=str(pq), kind="prompts", prompt_field="question"), "data.source")
    preflight_source(source(path=str(pq), kind="prompts", prompt_field="q", completion_field="a"), "data.source")
    with pytest.raises(SetupError, match=r"c.csv, row 2: \"a\" is null; .*\(eval.prompts.completion_field\): fix or "
                                         r"delete row 2"):
        preflight_source(source(path=str(csv), kind="prompts", prompt_field="q", completion_field="a"), "eval.prompts")


def test_a_corpus_whose_file_is_missing_is_named_before_anything_loads(tmp_path, monkeypatch):
    """data.source.corpus=tinystories without the shared data folder failed inside the run with a traceback
    (exit 1) that pointed at <repo>/../shared/data even for an installed package."""
    monkeypatch.setenv("DRAFTKIT_SHARED_DATA", str(tmp_path))
    cfg = compose(["+target.name_or_path=org/model", "data=corpus", "data.source.corpus=tinystories",
                   "draft.num_hidden_layers=2"])
    with pytest.raises(SetupError, match=r"data.source.corpus=tinystories: corpus 'tinystories' reads "
                                         r".*tinystories_val.txt, which does not exist: set DRAFTKIT_SHARED_DATA"):
        check_inputs(normalize_config(cfg), training=False)
    (tmp_path / "tinystories").mkdir()
    (tmp_path / "tinystories" / "tinystories_val.txt").write_text("Once upon a time.\n")
    check_inputs(normalize_config(cfg), training=False)


def test_a_relative_model_path_that_is_missing_shows_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SetupError, match=re.escape(f"'checkpoints/q/target' ({tmp_path}/checkpoints/q/target) does "
                                                   "not exist")):
        normalize_config(compose(["+target.name_or_path=checkpoints/q/target", "draft.num_hidden_layers=2"]))
