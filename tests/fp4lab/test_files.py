"""fp4lab.files: the one atomic writer (a reader sees the old file or the new one)."""

import pytest

from fp4lab.files import atomic, write_atomic


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "policy.json"
    write_atomic(path, "old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic(path) as tmp:
            tmp.write_text("half of the ne")
            raise RuntimeError("boom")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.json"]
    write_atomic(path, b"new")
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.json"]
