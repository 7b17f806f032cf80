"""A byte-identical episode copied into a second task folder under a new name (issue 28) is named as a
duplicate, with both paths, when either folder is paired (what the recordings sensor's runs do), not only
when both manifests enter one dataset. The earlier copy is kept whichever folder is paired first."""

from __future__ import annotations

import os
import shutil

import pytest

from dpflow_core.pairing import pair_recordings
from dpflow_core.recordings import samples

SPEC = samples.SampleSpec(seconds=1.0, width=64, height=48, gop_size=15)


@pytest.fixture(scope="module")
def output_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("recordings")
    a = samples.write_episode(root / "pick", "pick_0000", SPEC, seed=81)
    samples.write_episode(root / "pick", "pick_0001", SPEC, seed=82)
    other = samples.write_episode(root / "place", "place_0000", SPEC, seed=83)
    # The copy: pick_0000 renamed into the place folder (its status rewritten for its new stem), a minute later.
    copy_stem = "place_0007"
    for src, dst in ((a.raw_mcap, f"{copy_stem}.mcap"), (a.vio_mcap, f"{copy_stem}_vio.mcap")):
        shutil.copyfile(src, root / "place" / dst)
    text = a.vio_json.read_text().replace("pick_0000", copy_stem)
    (root / "place" / f"{copy_stem}_vio.json").write_text(text)
    later = a.vio_mcap.stat().st_mtime + 60
    for p in (root / "place").glob(f"{copy_stem}*"):
        os.utime(p, (later, later))
    # A sibling file of the same size but other bytes is hashed and passed over.
    same_size = root / "stack" / "stack_0000_vio.mcap"
    same_size.parent.mkdir()
    same_size.write_bytes(bytes(reversed(a.vio_mcap.read_bytes())))
    return root, a, other


def test_copy_in_another_task_folder_is_named_with_both_paths(output_root):
    root, original, other = output_root
    place = pair_recordings(root / "place")
    assert [a.stem for a in place.accepted] == ["place_0000"]
    [dup] = [r for r in place.rejected if r.code == "duplicate_episode"]
    assert dup.stem == "place_0007" and dup.path == str(root / "place" / "place_0007_vio.mcap")
    assert f"{root / 'place' / 'place_0007_vio.mcap'} is a byte copy of {original.vio_mcap} (task folder 'pick'" in dup.reason


def test_the_earlier_copy_is_kept_in_its_own_folder(output_root):
    root, _, _ = output_root
    pick = pair_recordings(root / "pick")
    assert [a.stem for a in pick.accepted] == ["pick_0000", "pick_0001"] and not pick.rejected
