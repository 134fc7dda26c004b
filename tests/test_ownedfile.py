"""OwnedFile on its own, with a name that is not the CDI spec's: the generic primitive keeps
its promises (atomic replace, no following, no clobbering, only its own leftovers removed)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hlplugin.deviceplugin.ownedfile import NotRegular, OwnedFile, read_regular


def test_replace_writes_content_mode_and_owner_and_removes_the_old_file(tmp_path: Path) -> None:
    owned = OwnedFile(tmp_path, "state.txt", 0o640)
    owned.replace(b"one\n")
    owned.replace(b"two\n")
    found = owned.read(1 << 10)
    assert found is not None
    content, st = found
    assert content == b"two\n" and stat.S_IMODE(st.st_mode) == 0o640 and owned.metadata_right(st)
    assert sorted(os.listdir(tmp_path)) == ["state.txt"]  # no temp file, no old copy


def test_a_symlink_directory_or_fifo_at_the_path_is_refused_and_left_alone(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"not ours\n")
    owned = OwnedFile(tmp_path, "state.txt", 0o644)
    for make in (lambda p: p.symlink_to(target), lambda p: p.mkdir(), os.mkfifo):
        make(owned.path)
        with pytest.raises(NotRegular):
            owned.read(1 << 10)  # a FIFO would block an open without O_NONBLOCK
        with pytest.raises(NotRegular):
            owned.replace(b"ours\n")
        assert target.read_bytes() == b"not ours\n"
        assert [n for n in os.listdir(tmp_path) if n.startswith(owned.temp_prefix)] == []
        if owned.path.is_dir() and not owned.path.is_symlink():
            owned.path.rmdir()
        else:
            owned.path.unlink()


def test_missing_is_none_and_a_read_is_bounded(tmp_path: Path) -> None:
    assert read_regular(tmp_path / "absent", 10) is None
    assert read_regular(tmp_path / "absent" / "below", 10) is None
    big = tmp_path / "big"
    big.write_bytes(b"x" * 100)
    found = read_regular(big, 10)
    assert found is not None and found[0] == b"x" * 10


def test_cleanup_removes_only_its_own_regular_leftovers(tmp_path: Path) -> None:
    owned = OwnedFile(tmp_path, "state.txt", 0o644)
    (tmp_path / f"{owned.temp_prefix}crashed").write_bytes(b"half")
    (tmp_path / f"{owned.temp_prefix}dir").mkdir()
    (tmp_path / ".other.tmp-x").write_bytes(b"someone else's")
    assert owned.cleanup_leftovers() == 1
    assert sorted(os.listdir(tmp_path)) == [".other.tmp-x", f"{owned.temp_prefix}dir"]
