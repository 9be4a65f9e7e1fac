"""Output paths (decode/outputs.py): checked before the work starts, written without touching any other file."""
import pytest

from decode.outputs import check_output_file, write_new_file


def test_write_new_file_keeps_a_file_made_meanwhile(tmp_path):
    out = tmp_path / "c.json"
    assert write_new_file("a", out) == out and out.read_text() == "a"
    kept = write_new_file("b", out)  # out exists now: it stays, the text goes to a new file beside it
    assert kept != out and kept.parent == tmp_path and kept.read_text() == "b" and out.read_text() == "a"
    assert write_new_file("c", out, overwrite=True) == out and out.read_text() == "c"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.json", kept.name])


def test_check_output_file_names_a_file_standing_where_a_folder_is_needed(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="afile' is a file, not a folder"):
        check_output_file(tmp_path / "afile" / "sub" / "c.json", "--out")
    with pytest.raises(ValueError, match="does not exist; create it"):
        check_output_file(tmp_path / "missing" / "c.json", "--out")


def test_a_full_disk_is_a_clear_error_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """A full disk raised a bare OSError (a traceback from `decode certify --out`, `loadtest --output`)."""
    import os

    import decode.outputs as outputs

    def full_disk(fd, mode):  # every write fails with ENOSPC, as on a full disk
        os.close(fd)
        return open("/dev/full", mode)

    monkeypatch.setattr(outputs.os, "fdopen", full_disk)
    out = tmp_path / "cert.json"
    with pytest.raises(ValueError, match=r"could not write .*cert.json .*No space left on device.*nothing was "
                                         r"written there"):
        write_new_file("{}" * 10000, out)
    assert list(tmp_path.iterdir()) == []
