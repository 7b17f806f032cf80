"""Lineage of a curated dataset: a trimmed copy is listed as what it is, derived from its recording.

A trial found the copy ``<curation>/trimmed/<STEM>_vio.mcap`` in ``lineage/recordings`` as
``| <STEM> | vio_mcap | <STEM>_vio.mcap | ... |`` under the recordings root: the original's name and root,
as if the untouched recording had trained, with nothing saying which of its stretches did."""

from __future__ import annotations

import json

import pytest

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.curation.apply import curate
from dpflow_core.files import sha256_file
from dpflow_core.pairing import pair_recordings, save_manifest
from dpflow_core.sim.faults import FaultSpec, read_truth
from dpflow_core.sim.record import SimRecordingSpec, record_task
from dpflow_dagster.defs.dataset import _inputs_table
from dpflow_dagster.lineage import dataset_lineage

pytestmark = pytest.mark.slow


def test_a_trimmed_copy_is_listed_as_a_copy_of_its_recording(tmp_path):
    task_dir = record_task(tmp_path / "rec", "pick_place", 3, seed=5, spec=SimRecordingSpec(width=32, height=32),
                           faults=FaultSpec(bad_fraction=0.34, kinds=("idle",)))
    (stem,) = [e["stem"] for e in read_truth(task_dir)["episodes"] if e["bad"]]
    manifest, _ = save_manifest(pair_recordings(task_dir), tmp_path / "work")
    cur = curate(manifest, tmp_path / "curation")
    trim = next(e for e in cur.episodes if e["stem"] == stem)["trim"]
    ds = convert(cur.manifest_path, tmp_path / "ds" / "dataset.npz", ConversionSettings(image_size=(32, 32)))
    source, copy = task_dir / f"{stem}_vio.mcap", tmp_path / "curation" / "trimmed" / f"{stem}_vio.mcap"
    meta = json.loads(ds.sidecar_path.read_text())

    # dataset.json: the copy's own path and hash, derived from the recording's, with the spans it keeps
    (entry,) = [e for e in meta["inputs"]["episodes"] if e["stem"] == stem]
    assert entry["files"]["vio_mcap"]["path"] == str(copy.absolute())
    assert entry["files"]["vio_mcap"]["sha256"] == sha256_file(copy) != sha256_file(source)
    derived = entry["derived_from"]
    assert (derived["path"], derived["sha256"], derived["size_bytes"]) == (
        str(source), sha256_file(source), source.stat().st_size)
    (cut,) = trim["cuts"]
    assert derived["cut_s"] == [[cut["start_s"], cut["end_s"]]]
    duration = next(e for e in cur.episodes if e["stem"] == stem)["figures"]["duration_s"]
    assert derived["kept_s"] == [s for s in ([0.0, cut["start_s"]], [cut["end_s"], duration]) if s[1] > s[0]]
    # what trained from it lies inside the kept spans
    parts = [e for e in meta["episodes"] if e["stem"] == stem]
    assert sum(p["duration_s"] for p in parts) <= sum(b - a for a, b in derived["kept_s"]) + 1e-6
    assert all("derived_from" not in e for e in meta["inputs"]["episodes"] if e["stem"] != stem)

    # the Dagster lineage: the copy by its full path and hash, then the recording it was cut from
    lineage = dataset_lineage(str(ds.path))
    assert lineage["lineage/trimmed_copies"] == 1
    rows = [r for r in lineage["lineage/recordings"].value.splitlines() if r.startswith(f"| {stem} | vio_mcap")]
    assert rows == [
        f"| {stem} | vio_mcap (trimmed copy, trained) | {copy.absolute()} | {copy.stat().st_size} | `{sha256_file(copy)}` |",
        f"| {stem} | vio_mcap source (dpflow curate (idle stretches trimmed): kept "
        + ", ".join(f"{a:.2f}-{b:.2f} s" for a, b in derived["kept_s"])
        + f"; cut {cut['start_s']:.2f}-{cut['end_s']:.2f} s) | {source} | {source.stat().st_size} | `{sha256_file(source)}` |",
    ]
    # an untouched recording keeps its plain row
    other = next(e["stem"] for e in meta["inputs"]["episodes"] if e["stem"] != stem)
    plain = task_dir / f"{other}_vio.mcap"
    assert f"| {other} | vio_mcap | {plain.name} | {plain.stat().st_size} | `{sha256_file(plain)}` |" \
        in lineage["lineage/recordings"].value
    # and the dataset asset's inputs table says the same
    assert f"`{sha256_file(copy)}` (trimmed copy of `{sha256_file(source)}`)" in _inputs_table(meta)
