"""Pre-flight checks of a data source: fields present and text, read as training will, before anything loads."""
import pytest
from omegaconf import OmegaConf

from distill.checks import preflight_source
from distill.config import SetupError


def _src(**kw):
    return OmegaConf.create(kw)


def test_parquet_and_csv_fields_are_checked_before_loading(tmp_path):
    """A missing field or an empty cell in parquet/csv was found only after the models loaded, with a message
    that named no setting ("set the *_field key")."""
    import datasets

    pq, csv = tmp_path / "p.parquet", tmp_path / "c.csv"
    datasets.Dataset.from_dict({"q": ["a b", "c d"], "a": [" x", " y"]}).to_parquet(str(pq))
    csv.write_text("q,a\na b, x\nc d,\n")
    with pytest.raises(SetupError, match=r"p.parquet, row 1: field 'question' not found .*set data.source.prompt_field"):
        preflight_source(_src(path=str(pq), kind="prompts", prompt_field="question"), "data.source")
    preflight_source(_src(path=str(pq), kind="prompts", prompt_field="q", completion_field="a"), "data.source")
    with pytest.raises(SetupError, match=r"c.csv, row 2: \"a\" is null; .*\(eval.prompts.completion_field\): fix or "
                                         r"delete row 2"):
        preflight_source(_src(path=str(csv), kind="prompts", prompt_field="q", completion_field="a"), "eval.prompts")
