"""File names that are not valid UTF-8 (issue 28): pairing refuses them by a safe display name, the report
and conversion of a hand-made manifest holding one end without a traceback or a half-written folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dpflow_core.conversion import ConversionSettings, convert
from dpflow_core.errors import ConversionError
from dpflow_core.files import display_name
from dpflow_core.pairing import pair_recordings
from dpflow_core.report import write_report
from recording_fixtures import write_small_episode

BAD = b"take\xff\xfe2"  # Latin-1 bytes in a name, as a Windows share may hand them over


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    d = tmp_path_factory.mktemp("odd") / "pick"
    write_small_episode(d, "take1", seed=1)
    write_small_episode(d, "takeQ2", seed=2)
    for suffix in (".mcap", "_vio.mcap", "_vio.json"):
        os.rename(d / f"takeQ2{suffix}", os.fsencode(d) + b"/" + BAD + suffix.encode())
    status = os.fsencode(d) + b"/" + BAD + b"_vio.json"
    doc = {k: v for k, v in json.loads(Path(os.fsdecode(status)).read_text()).items()
           if not (isinstance(v, str) and "takeQ2" in v)}
    Path(os.fsdecode(status)).write_text(json.dumps(doc))
    return d


def test_display_name_escapes_only_the_bad_bytes():
    assert display_name(os.fsdecode(BAD)) == "take\\xff\\xfe2"
    assert display_name("prise_é_1") == "prise_é_1" and display_name("\ud800x") == "\\ud800x"


def test_pairing_refuses_the_name_by_its_display_name(task):
    m = pair_recordings(task)
    assert [a.stem for a in m.accepted] == ["take1"]
    (r,) = m.rejected
    assert r.code == "undecodable_name" and r.stem == "take\\xff\\xfe2" and "not valid UTF-8" in r.reason
    json.dumps(m.to_dict(), ensure_ascii=False).encode("utf-8")  # the manifest is writable as UTF-8


def test_report_and_convert_of_a_manifest_that_accepts_it(task, tmp_path):
    entries = [{"stem": os.fsdecode(s), "files": {"vio_mcap": {"path": os.fsdecode(s + b"_vio.mcap")}}}
               for s in (b"take1", BAD)]
    manifest = {"task": "pick", "root": str(task), "accepted": entries, "rejected": []}
    result = write_report(manifest, tmp_path / "report")
    html = (tmp_path / "report" / "report.html").read_text(encoding="utf-8")
    assert "take\\xff\\xfe2" in html and [e.stem for e in result.episodes] == ["take1"]
    assert json.loads((tmp_path / "report" / "quality.json").read_text(encoding="utf-8"))["rejected"][0]["code"] == "invalid_stem"
    def entry(stem: bytes) -> dict:  # every field a manifest needs, so that the stem is what is refused
        files = {role: {"path": os.fsdecode(stem + suffix), "size_bytes": 1, "sha256": "0" * 64}
                 for role, suffix in (("raw_mcap", b".mcap"), ("vio_mcap", b"_vio.mcap"), ("vio_json", b"_vio.json"))}
        return {"stem": os.fsdecode(stem), "files": files, "vio_status": {"status": "success"}, "validation": {}}

    full = {"manifest_version": 1, "root": str(task), "task": "pick", "created_at": "2026-01-01T00:00:00+00:00",
            "topics": {}, "accepted": [entry(b"take1"), entry(BAD)], "rejected": []}
    with pytest.raises(ConversionError) as err:
        convert(full, tmp_path / "ds" / "dataset.npz", ConversionSettings(image_size=(32, 24)), cache=False)
    assert err.value.code == "bad_manifest" and "take\\xff\\xfe2" in err.value.reason and "invalid stem" in err.value.reason
    assert not (tmp_path / "ds").exists()
