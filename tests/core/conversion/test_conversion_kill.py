"""Atomicity: a conversion SIGKILLed while writing leaves the previous dataset untouched."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import time
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from dpflow_core.recordings import samples
from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.recordings.topics import DAS_DEFAULT

SPEC = samples.SampleSpec(seconds=2.5, width=160, height=120, gop_size=15)


def _entry(path: Path) -> dict:
    return {"path": str(path), "size_bytes": path.stat().st_size, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def _manifest(eps, root) -> dict:
    return {
        "manifest_version": 1, "root": str(root), "task": "pick", "created_at": "2026-01-01T00:00:00+00:00",
        "topics": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(DAS_DEFAULT).items()},
        "accepted": [{"stem": e.stem, "vio_status": {"status": "success"}, "validation": {},
                      "files": {"raw_mcap": _entry(e.raw_mcap), "vio_mcap": _entry(e.vio_mcap),
                                "vio_json": _entry(e.vio_json)}} for e in eps],
        "rejected": [],
    }


@pytest.mark.timeout(120)
def test_sigkill_while_writing_leaves_previous_dataset_untouched(tmp_path):
    root = tmp_path / "pick"
    eps = [samples.write_episode(root, f"pick_{k:04d}", replace(SPEC, seconds=2.5), seed=60 + k) for k in range(3)]
    manifest = tmp_path / "manifest.json"
    manifest.write_text(json.dumps(_manifest(eps, root)))
    out_dir = tmp_path / "ds"
    out = out_dir / "dataset.npz"
    convert(str(manifest), out, ConversionSettings(image_size=(64, 48)), workers=1)
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    assert sorted(before) == ["dataset.json", "dataset.npz", "norm_stats.json"]

    # 640x480 frames make the new file ~200 MB, so the write lasts long enough to be caught
    proc = subprocess.Popen(
        ["dpflow", "convert", str(manifest), "-o", str(out), "--backup", "--image-size", "640,480", "-j", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    partial = None
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            found = list(out_dir.glob(".dataset.npz.partial-*"))
            if found and found[0].stat().st_size > 8 << 20:
                partial = found[0]
                os.killpg(proc.pid, signal.SIGKILL)
                break
            time.sleep(0.001)
    finally:
        if proc.poll() is None and partial is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert partial is not None, "the conversion finished before it could be killed while writing"
    assert proc.returncode == -signal.SIGKILL

    # the previous dataset, its sidecar and norm stats are byte-identical; nothing new is visible
    after = {p.name: p.read_bytes() for p in out_dir.iterdir() if not p.name.startswith(".")}
    assert after == before
    # what was left is an incomplete hidden file (no central directory), not a dataset
    with pytest.raises(zipfile.BadZipFile):
        zipfile.ZipFile(partial)

    # the next conversion removes the dead run's leftovers and installs a complete dataset
    r = convert(str(manifest), out, ConversionSettings(image_size=(32, 24)), workers=1, backup=True)
    assert partial.name in r.metadata["stale_files_removed"]
    assert not any(p.name.startswith(".") for p in out_dir.iterdir())
    assert hashlib.sha256(out.read_bytes()).hexdigest() == r.sha256
    backups = sorted(out_dir.glob("dataset.bak-*.npz"))
    assert len(backups) == 1 and backups[0].read_bytes() == before["dataset.npz"]
