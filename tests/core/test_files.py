"""The atomic-output and hashing helpers of dpflow_core.files."""

from __future__ import annotations

import hashlib
import os
import stat
import zlib
from pathlib import Path

import numpy as np
import pytest

from dpflow_core.files import (
    atomic_output, atomic_path, crc32_combine, sha256_file, temp_path_for, write_text_atomic,
)


def _entries(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_atomic_output_writes_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    with atomic_output(target, "w") as fh:
        fh.write('{"a": 1}\n')
        assert not target.exists()  # nothing at the final name until the block ends
    assert target.read_text() == '{"a": 1}\n'
    assert _entries(tmp_path) == ["out.json"]


def test_an_exception_inside_leaves_the_old_file_intact_and_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old contents")
    with pytest.raises(RuntimeError, match="writer failed"):
        with atomic_output(target, "wb") as fh:
            fh.write(b"new, half written")
            raise RuntimeError("writer failed")
    assert target.read_bytes() == b"old contents"
    assert _entries(tmp_path) == ["out.bin"]


def test_an_exception_leaves_no_file_when_there_was_none(tmp_path):
    with pytest.raises(ValueError):
        with atomic_path(tmp_path / "new.png", suffix=".png") as tmp:
            assert tmp.name.startswith(".new.png.tmp-") and tmp.suffix == ".png" and tmp.parent == tmp_path
            tmp.write_bytes(b"\x89PNG")
            raise ValueError("no")
    assert _entries(tmp_path) == []


def test_overwrite_false_refuses_an_existing_file_and_keeps_it(tmp_path):
    target = tmp_path / "manifest.json"
    target.write_text("first")
    with pytest.raises(FileExistsError, match="manifest.json"):
        write_text_atomic(target, "second", overwrite=False)
    assert target.read_text() == "first"
    assert _entries(tmp_path) == ["manifest.json"]


def test_overwrite_false_loses_a_race_without_clobbering(tmp_path):
    target = tmp_path / "stats.json"
    with pytest.raises(FileExistsError):
        with atomic_output(target, "w", overwrite=False) as fh:
            fh.write("mine")
            target.write_text("theirs")  # another writer got there first
    assert target.read_text() == "theirs"
    assert _entries(tmp_path) == ["stats.json"]


def test_overwrite_true_replaces(tmp_path):
    target = tmp_path / "a.txt"
    target.write_text("old")
    assert write_text_atomic(target, "new") == target
    assert target.read_text() == "new"


def test_temporary_gets_the_permissions_of_a_plain_open(tmp_path):
    old = os.umask(0o022)
    try:
        tmp = temp_path_for(tmp_path / "x")
        plain = tmp_path / "plain"
        plain.write_text("")
    finally:
        os.umask(old)
    assert stat.S_IMODE(tmp.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o644
    assert temp_path_for(tmp_path / "x") != tmp


def test_missing_folder_and_bad_mode_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_text_atomic(tmp_path / "no" / "such.txt", "x")
    with pytest.raises(ValueError, match="mode"):
        with atomic_output(tmp_path / "a", "a"):
            pass


def test_sha256_file_matches_hashlib_over_several_blocks(tmp_path):
    data = os.urandom(3 * 1024 + 17)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert sha256_file(path, chunk_bytes=1024) == hashlib.sha256(data).hexdigest()
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert sha256_file(empty) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_install_dir_puts_a_complete_folder_in_place_and_never_replaces_one(tmp_path, monkeypatch):
    from dpflow_core import files

    tmp = tmp_path / ".partial-run"
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.bin").write_bytes(b"a" * 5000)
    (tmp / "sub" / "b.txt").write_text("b")
    synced = []
    real = files._fsync_file
    monkeypatch.setattr(files, "_fsync_file", lambda p: (synced.append(Path(p).name), real(p)))
    final = tmp_path / "run"
    assert files.install_dir(tmp, final) is True
    assert sorted(synced) == ["a.bin", "b.txt"]  # every file reached the disk before the rename
    assert not tmp.exists() and (final / "a.bin").read_bytes() == b"a" * 5000 and (final / "sub" / "b.txt").read_text() == "b"

    # a second writer of the same folder loses: the first one's files stay, its own folder is left to it
    other = tmp_path / ".partial-run-2"
    other.mkdir()
    (other / "a.bin").write_bytes(b"other")
    assert files.install_dir(other, final) is False
    assert (final / "a.bin").read_bytes() == b"a" * 5000 and (other / "a.bin").read_bytes() == b"other"
    # durable=False (the conversion cache): the same rename, no file waits for the disk
    synced.clear()
    assert files.install_dir(other, tmp_path / "run-2", durable=False) is True
    assert synced == [] and (tmp_path / "run-2" / "a.bin").read_bytes() == b"other"
    other.mkdir()
    (other / "a.bin").write_bytes(b"other")
    # a rename that fails for another reason is raised, nothing moved
    with pytest.raises(OSError):
        files.install_dir(other, tmp_path / "no such folder" / "run")
    assert (other / "a.bin").is_file()


def test_crc32_combine_equals_zlib_over_the_concatenation():
    """Random parts (empty ones included): combining the parts' CRCs gives zlib.crc32 of A + B, and
    combining a prefix's CRC with a longer prefix's gives the CRC of the slice between them."""
    rng = np.random.default_rng(7)
    for n1, n2 in [(0, 0), (0, 1), (1, 0), (3, 5), *((int(a), int(b)) for a, b in rng.integers(0, 70_000, (12, 2)))]:
        a, b = rng.bytes(n1), rng.bytes(n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), n2) == zlib.crc32(a + b), (n1, n2)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(a + b), n2) == zlib.crc32(b), (n1, n2)


def test_crc32_combine_over_a_zero_tail_past_4_gib():
    """A tail of 2^32 + 3 zero bytes (its length needs more than 32 bits), CRC by zlib in 64 MiB
    blocks, against the combination; and lengths out of range are refused."""
    head = b"dpflow frames"
    zeros = bytes(64 << 20)
    n = (1 << 32) + 3
    tail_crc, whole = 0, zlib.crc32(head)
    left = n
    while left:
        block = memoryview(zeros)[: min(left, len(zeros))]
        tail_crc, whole = zlib.crc32(block, tail_crc), zlib.crc32(block, whole)
        left -= len(block)
    assert crc32_combine(zlib.crc32(head), tail_crc, n) == whole
    with pytest.raises(ValueError, match="len2"):
        crc32_combine(0, 0, -1)
    with pytest.raises(ValueError, match="len2"):
        crc32_combine(0, 0, 1 << 64)
