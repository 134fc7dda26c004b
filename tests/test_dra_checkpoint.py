"""The checkpoint of prepared claims (deviceplugin/kubelet/dra/checkpoint.py): read whole or refused, saying
why; written atomically; never following, blocking on or replacing what is not ours."""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from pathlib import Path

import pytest

from hlplugin.deviceplugin.kubelet.dra.checkpoint import (
    MODE,
    VERSION,
    Checkpoint,
    Corrupt,
    InstanceLock,
    decode,
    encode,
)
from hlplugin.deviceplugin.ownedfile import NotRegular

KIND = "example.com/prepared-claims"
ENTRIES = {"uid-1": {"namespace": "ns", "name": "claim", "devices": [
    {"requests": [], "pool": "node-a", "device": "kvm", "ids": ["example.com/x=kvm"]}]}}


def checkpoint(directory: Path, **kwargs: int) -> Checkpoint:
    return Checkpoint(directory, "checkpoint.json", KIND, **kwargs)


def test_what_is_saved_is_loaded_and_a_missing_file_is_an_empty_record(tmp_path: Path) -> None:
    record = checkpoint(tmp_path / "state")
    assert record.load() == {}
    record.save(ENTRIES)
    assert checkpoint(tmp_path / "state").load() == ENTRIES
    st = os.lstat(record.path)
    assert stat.S_IMODE(st.st_mode) == MODE and st.st_uid == os.geteuid()
    document = json.loads(record.path.read_bytes())
    assert document["version"] == VERSION and document["kind"] == KIND
    assert document["checksum"].startswith("sha256:")
    assert [n for n in os.listdir(record.path.parent)] == ["checkpoint.json"]  # no temp left


def test_encoding_is_deterministic_so_an_unchanged_record_writes_the_same_bytes() -> None:
    reordered = {"uid-1": dict(reversed(list(ENTRIES["uid-1"].items())))}
    assert encode(KIND, ENTRIES) == encode(KIND, reordered)
    assert decode(KIND, encode(KIND, ENTRIES)) == ENTRIES


def _flip_one_character(content: bytes) -> bytes:
    return content.replace(b'"node-a"', b'"node-b"')


def _truncate(content: bytes) -> bytes:
    return content[: len(content) // 2]


def _future_version(content: bytes) -> bytes:
    document = json.loads(content)
    document["version"] = VERSION + 1
    return json.dumps(document).encode()


def _other_kind(content: bytes) -> bytes:
    document = json.loads(content)
    document["kind"] = "someone.else/checkpoint"
    return json.dumps(document).encode()


def _no_checksum(content: bytes) -> bytes:
    document = json.loads(content)
    del document["checksum"]
    return json.dumps(document).encode()


def _entries_not_an_object(content: bytes) -> bytes:
    document = json.loads(content)
    document["entries"] = ["uid-1"]
    return json.dumps(document).encode()


@pytest.mark.parametrize(("damage", "says"), [
    (_flip_one_character, "does not match its checksum"),
    (_truncate, "is not JSON"),
    (lambda content: b"\xff\xfe" + content, "is not JSON"),
    (lambda content: b"", "is not JSON"),
    (lambda content: b"[]", "is not a example.com/prepared-claims checkpoint"),
    (_future_version, "written by a newer version"),
    (_other_kind, "is not a example.com/prepared-claims checkpoint"),
    (_no_checksum, "does not match its checksum"),
    (_entries_not_an_object, "has no entries object"),
])
def test_a_damaged_file_is_refused_saying_why_and_left_as_it_is(
        tmp_path: Path, damage: object, says: str) -> None:
    record = checkpoint(tmp_path)
    record.save(ENTRIES)
    damaged = damage(record.path.read_bytes())  # type: ignore[operator]
    record.path.write_bytes(damaged)
    with pytest.raises(Corrupt, match=says) as refused:
        record.load()
    assert str(record.path) in str(refused.value)
    assert record.path.read_bytes() == damaged  # evidence for the operator, untouched


def test_a_file_over_the_bound_is_refused_without_reading_it_all(tmp_path: Path) -> None:
    record = checkpoint(tmp_path, max_bytes=1024)
    record.path.write_bytes(b" " * 4096)
    with pytest.raises(Corrupt, match="larger than 1024 bytes"):
        record.load()


def test_a_symlink_is_neither_followed_on_read_nor_replaced_on_write(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_bytes(encode(KIND, ENTRIES))  # a valid checkpoint: following would trust it
    (tmp_path / "state").mkdir()
    record = checkpoint(tmp_path / "state")
    record.path.symlink_to(elsewhere)
    with pytest.raises(Corrupt, match="a symlink"):
        record.load()
    with pytest.raises(NotRegular):
        record.save({})
    assert record.path.is_symlink() and os.readlink(record.path) == str(elsewhere)
    assert elsewhere.read_bytes() == encode(KIND, ENTRIES)


def test_a_fifo_does_not_block_the_read_and_is_not_replaced(tmp_path: Path) -> None:
    record = checkpoint(tmp_path)
    os.mkfifo(record.path)
    outcome: list[BaseException] = []

    def read() -> None:
        try:
            record.load()
        except Corrupt as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(timeout=30)
    assert not reader.is_alive(), "the read blocked on a FIFO"
    assert "a FIFO" in str(outcome[0])
    with pytest.raises(NotRegular):
        record.save(ENTRIES)
    assert stat.S_ISFIFO(os.lstat(record.path).st_mode)


def test_a_directory_at_the_path_is_refused_and_kept(tmp_path: Path) -> None:
    record = checkpoint(tmp_path)
    record.path.mkdir()
    (record.path / "inside").write_text("not ours")
    with pytest.raises(Corrupt, match="a directory"):
        record.load()
    with pytest.raises((NotRegular, OSError)):
        record.save(ENTRIES)
    assert (record.path / "inside").read_text() == "not ours"


def test_a_crash_between_write_and_rename_leaves_the_old_record_whole(tmp_path: Path) -> None:
    """The temp file of an interrupted save is not the checkpoint: the old one loads, and the
    leftover is removed (ours only: a foreign file with another name stays)."""
    record = checkpoint(tmp_path)
    record.save(ENTRIES)
    leftover = tmp_path / f"{record.file.temp_prefix}0123456789abcdef"
    leftover.write_bytes(encode(KIND, {})[:10])
    foreign = tmp_path / "notes.txt"
    foreign.write_text("an operator's")
    assert record.load() == ENTRIES
    assert record.cleanup_leftovers() == 1
    assert not leftover.exists() and foreign.read_text() == "an operator's"


def test_a_save_replaces_the_whole_record_and_readers_never_see_a_mix(tmp_path: Path) -> None:
    """Concurrent readers of a record being rewritten see one whole version or the other."""
    record = checkpoint(tmp_path)
    small, large = {"a": {"n": 1}}, {f"uid-{i}": {"n": i, "pad": "x" * 200} for i in range(500)}
    record.save(small)
    seen: set[int] = set()
    failures: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            try:
                seen.add(len(checkpoint(tmp_path).load()))
            except BaseException as exc:  # pragma: no cover - the failure the test looks for
                failures.append(exc)
                return

    readers = [threading.Thread(target=read) for _ in range(2)]
    for thread in readers:
        thread.start()
    try:
        for i in range(40):
            record.save(large if i % 2 else small)
    finally:
        done.set()
        for thread in readers:
            thread.join(timeout=30)
    assert not failures, failures[:1]
    assert seen <= {1, 500} and seen


def test_a_record_too_large_to_read_back_is_never_written(tmp_path: Path) -> None:
    """A save that load() would refuse would lock the driver out of its own record: refused
    before anything is written, and the old record stays."""
    record = checkpoint(tmp_path, max_bytes=2048)
    record.save(ENTRIES)
    with pytest.raises(OSError, match="over the 2048 a checkpoint may have") as refused:
        record.save({f"uid-{i}": {"pad": "x" * 100} for i in range(40)})
    assert refused.value.errno == errno.EFBIG
    assert record.load() == ENTRIES


def test_the_instance_lock_is_exclusive_and_never_takes_what_is_not_a_regular_file(
        tmp_path: Path) -> None:
    lock = InstanceLock(tmp_path / "state", "checkpoint.lock")
    held = lock.try_acquire()
    assert held is not None
    try:
        assert InstanceLock(tmp_path / "state", "checkpoint.lock").try_acquire() is None
    finally:
        os.close(held)
    again = lock.try_acquire()
    assert again is not None
    os.close(again)
    assert os.listdir(tmp_path / "state") == ["checkpoint.lock"]  # never removed
    target = tmp_path / "target"
    target.write_text("not ours")
    for name, make in (("link", lambda p: p.symlink_to(target)), ("fifo", os.mkfifo),
                       ("dir", os.mkdir)):
        make(tmp_path / name)
        with pytest.raises(NotRegular):
            InstanceLock(tmp_path, name).try_acquire()
    assert target.read_text() == "not ours" and (tmp_path / "link").is_symlink()
