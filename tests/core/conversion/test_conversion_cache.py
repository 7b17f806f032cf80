"""The per-episode conversion cache: incremental datasets byte-identical to full conversions,
keys that follow the input and the options, the size limit and the `dpflow cache` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dpflow_core.conversion import ConversionSettings, align_job_episode, alignment_job, convert, load_inputs
from dpflow_core.episode_cache import EpisodeCache, parse_size
from dpflow_core.recordings import samples
from dpflow_core.recordings.topics import DAS_DEFAULT
from test_conversion import SIZE, SPEC, manifest_for


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-task") / "pick"
    eps = [samples.write_episode(root, f"pick_{k:04d}", replace(SPEC, seconds=2.0 + 0.2 * k), seed=40 + k)
           for k in range(3)]
    return root, eps


@pytest.fixture(scope="module")
def full(task, tmp_path_factory):
    """The three episodes converted without any cache: the reference bytes."""
    root, eps = task
    out = tmp_path_factory.mktemp("full") / "dataset.npz"
    return convert(manifest_for(eps, root), out, ConversionSettings(image_size=SIZE), workers=1, cache=False)


def _du(folder: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def test_adding_an_episode_aligns_only_it_and_gives_the_full_conversion_bytes(task, full, tmp_path):
    root, eps = task
    cache = EpisodeCache(tmp_path / "cache")
    first = convert(manifest_for(eps[:2], root), tmp_path / "two.npz", ConversionSettings(image_size=SIZE),
                    workers=1, cache=cache)
    assert first.metadata["cache"] == {"dir": str(cache.root), "episodes_reused": 0, "episodes_aligned": 2}
    assert len(cache.entries()) == 2

    grown = convert(manifest_for(eps, root), tmp_path / "three.npz", ConversionSettings(image_size=SIZE),
                    workers=1, cache=cache)
    assert grown.metadata["cache"]["episodes_reused"] == 2 and grown.metadata["cache"]["episodes_aligned"] == 1
    assert [e["cached"] for e in grown.metadata["episodes"]] == [True, True, False]
    assert grown.sha256 == full.sha256
    assert grown.path.read_bytes() == full.path.read_bytes()
    # The cache's frames survive the write (the next conversion reads them again).
    assert len(cache.entries()) == 3
    again = convert(manifest_for(eps, root), tmp_path / "again.npz", ConversionSettings(image_size=SIZE),
                    workers=2, cache=cache)
    assert again.metadata["cache"]["episodes_reused"] == 3 and again.path.read_bytes() == full.path.read_bytes()
    assert again.metadata["episodes"][0]["convert_seconds"] == 0.0


def test_a_changed_option_or_rewritten_input_is_aligned_anew(task, full, tmp_path):
    root, eps = task
    cache = EpisodeCache(tmp_path / "cache")
    convert(manifest_for(eps, root), tmp_path / "a.npz", ConversionSettings(image_size=SIZE), workers=1, cache=cache)
    other = convert(manifest_for(eps, root), tmp_path / "b.npz", ConversionSettings(image_size=(32, 24)),
                    workers=1, cache=cache)
    assert other.metadata["cache"]["episodes_reused"] == 0 and other.image_size == (32, 24)
    option = convert(manifest_for(eps, root), tmp_path / "c.npz",
                     ConversionSettings(image_size=SIZE, min_overlap_fraction=0.4), workers=1, cache=cache)
    assert option.metadata["cache"]["episodes_reused"] == 0

    # Same bytes written again (new mtime and inode): the input is read and hashed again, not trusted.
    vio = eps[1].vio_mcap
    data = vio.read_bytes()
    tmp = vio.with_name(vio.name + ".rewrite")
    tmp.write_bytes(data)
    os.replace(tmp, vio)
    redo = convert(manifest_for(eps, root), tmp_path / "d.npz", ConversionSettings(image_size=SIZE),
                   workers=1, cache=cache)
    assert [e["cached"] for e in redo.metadata["episodes"]] == [True, False, True]
    assert redo.path.read_bytes() == full.path.read_bytes()


def test_size_limit_prunes_least_recently_used_first(task, tmp_path):
    root, eps = task
    cache = EpisodeCache(tmp_path / "cache")
    for k, ep in enumerate(eps):
        convert(manifest_for([ep], root), tmp_path / f"one{k}.npz", ConversionSettings(image_size=SIZE),
                workers=1, cache=cache)
        for e in cache.entries():
            if e.last_used > 1e9:  # the entry just made: give each a distinct last use, oldest first
                os.utime(e.path / "result.json", (1000.0 + 10 * k, 1000.0 + 10 * k))
    entries = cache.entries()
    assert len(entries) == 3 and [e.size_bytes for e in entries] == [_du(e.path) for e in entries]
    keep = entries[-1].size_bytes
    removed = cache.prune(max_bytes=keep)
    assert [e.key for e in removed] == [e.key for e in entries[:2]]
    assert [e.key for e in cache.entries()] == [entries[-1].key] and _du(cache.root) == keep

    # A killed conversion's scratch folder goes with the next prune; a running one's stays.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = cache.root / f".tmp-{dead.pid}-0000"
    mine = cache.new_dir()
    left.mkdir()
    (left / "x.npy").write_bytes(b"1")
    cache.prune()
    assert not left.exists() and mine.exists()


def test_cache_command_shows_and_prunes(task, tmp_path):
    root, eps = task
    cache_dir = tmp_path / "cache"
    convert(manifest_for(eps[:2], root), tmp_path / "x.npz", ConversionSettings(image_size=SIZE),
            workers=1, cache=EpisodeCache(cache_dir))
    env = {**os.environ, "DPFLOW_CACHE_DIR": str(cache_dir)}
    dpflow = [str(Path(sys.executable).parent / "dpflow")]
    shown = subprocess.run([*dpflow, "cache", "show", "--json"], env=env, capture_output=True, text=True, check=True)
    doc = json.loads(shown.stdout)
    assert doc["dir"] == str(cache_dir) and doc["entries"] == 2 and doc["size_bytes"] == _du(cache_dir)
    pruned = subprocess.run([*dpflow, "cache", "prune", "--max-size", "0"], env=env, capture_output=True, text=True)
    assert pruned.returncode == 0, pruned.stderr
    assert "removed 2 entries" in pruned.stdout and _du(cache_dir) == 0
    bad = subprocess.run([*dpflow, "cache", "prune", "--max-size", "lots"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "--max-size must be a size in bytes such as 500M or 20G, got 'lots'" in bad.stderr


@pytest.mark.parametrize("text, value", [("0", 0), ("1500", 1500), ("500M", 500 << 20), ("20G", 20 << 30),
                                         ("2GiB", 2 << 30), ("1.5k", 1536)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def test_alignment_reads_its_input_once_and_checks_its_sha256(task):
    """The input SHA-256 is computed from the bytes the MCAP parser reads: one read of the file."""
    root, eps = task
    inputs = load_inputs(manifest_for(eps[:1], root))
    job = alignment_job(inputs.episodes[0], ConversionSettings(image_size=SIZE, gap_policy="reject"), DAS_DEFAULT, True)
    align_job_episode(job, None)  # warm-up: imports, codec and schema caches
    before = _rchar()
    ep = align_job_episode(job, None)
    read = _rchar() - before
    size = eps[0].vio_mcap.stat().st_size
    assert ep.input_sha256 == inputs.episodes[0].sha256
    assert size <= read < 1.1 * size, (read, size)
    assert np.asarray(ep.rgb).shape[1:] == (SIZE[1], SIZE[0], 3)
