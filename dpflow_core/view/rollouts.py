"""Closed-loop rollouts of the simulated world, in Rerun.

A rollout folder (written by :mod:`dpflow_core.sim`) holds ``rollouts.json`` (the policy: a list of
records with ``seed``, ``success``, ``failure_mode``, ``time_to_success_s``, ``duration_s``,
``decisions``, ``grasp_attempts``, ``latency``, ``predict_s``), ``rollouts_<baseline>.json`` of the
same form, ``closed_loop.json`` (the summaries) and, for the first episodes, ``trace_<seed>.npz``:

    t_s (T,) float64 s           tcp_pos (T, 3) m      tcp_rotvec (T, 3) rad
    opening (T,) m               target_pos (T, 3) m   frame_t_s (F,) s
    wrist (F, H, W, 3) uint8 RGB scene (F, h, w, 3) uint8 RGB

Each trace is shown on the ``time`` timeline (its ``t_s``, s from the rollout start):

    world/seed_<seed>/tcp        Transform3D of the executed TCP pose, with its axes
    world/seed_<seed>/track      the executed positions as one line strip (static)
    world/seed_<seed>/target     the target position at each step
    opening/seed_<seed>          the gripper opening (m)
    cameras/seed_<seed>/wrist, cameras/seed_<seed>/scene    the camera frames at ``frame_t_s``
    outcome/seed_<seed>          TextLog at the end: success and its time, or the failure mode
    summary                      every record of every file and ``closed_loop.json`` (static, markdown)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpflow_core.view.rrd import TIME, ViewError, durations, output_path, rrd_writer

#: Members of ``trace_<seed>.npz`` and their per-row shapes (after the time axis).
TRACE_MEMBERS = {"t_s": (), "tcp_pos": (3,), "tcp_rotvec": (3,), "opening": (), "target_pos": (3,),
                 "frame_t_s": (), "wrist": None, "scene": None}
RECORD_COLUMNS = ("seed", "success", "failure_mode", "time_to_success_s", "duration_s", "decisions",
                  "grasp_attempts", "predict_s")


@dataclass(frozen=True)
class RolloutsView:
    """What :func:`view_rollouts` wrote: ``path``, the ``source`` folder, the record counts per
    file (``records``: ``policy`` and each baseline) and the seeds whose traces were shown."""

    path: Path
    source: Path
    records: dict[str, int]
    traced: list[int]


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ViewError(f"cannot be read as JSON: {exc}", path, code="bad_rollouts") from exc


def load_trace(path: str | Path) -> dict[str, np.ndarray]:
    """The members of one ``trace_<seed>.npz``, checked against the contract above.

    Raises:
        ViewError: a member is missing, or its shape disagrees with ``t_s`` / ``frame_t_s``.
    """
    path = Path(path)
    try:
        with np.load(path) as npz:
            trace = {k: npz[k] for k in TRACE_MEMBERS if k in npz.files}
    except (OSError, ValueError) as exc:
        raise ViewError(f"not a readable .npz: {exc}", path, code="bad_trace") from exc
    missing = [k for k in TRACE_MEMBERS if k not in trace]
    if missing:
        raise ViewError(f"members {missing} are missing (a rollout trace has {list(TRACE_MEMBERS)})", path,
                        code="bad_trace")
    n, f = len(trace["t_s"]), len(trace["frame_t_s"])
    for key, tail in TRACE_MEMBERS.items():
        arr, rows = trace[key], (f if key in ("frame_t_s", "wrist", "scene") else n)
        ok = len(arr) == rows and (tail is None or arr.shape[1:] == tail)
        if tail is None:
            ok = ok and arr.ndim == 4 and arr.shape[-1] == 3 and arr.dtype == np.uint8
        if not ok:
            raise ViewError(f"member {key!r} has shape {arr.shape} {arr.dtype}, expected ({rows}, "
                            f"{'H, W, 3) uint8' if tail is None else ', '.join(map(str, tail)) + ')'}", path,
                            code="bad_trace")
    return trace


def _summary(records: dict[str, list[dict]], closed_loop) -> str:
    lines = ["# Closed-loop rollouts", ""]
    for name, recs in records.items():
        ok = sum(bool(r.get("success")) for r in recs)
        lines += [f"## {name}: {ok} of {len(recs)} succeeded", "",
                  "| " + " | ".join(RECORD_COLUMNS) + " |", "|" + "---|" * len(RECORD_COLUMNS)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in RECORD_COLUMNS) + " |" for r in recs]
        lines.append("")
    if closed_loop is not None:
        lines += ["## closed_loop.json", "", "```json", json.dumps(closed_loop, indent=2), "```"]
    return "\n".join(lines)


def view_rollouts(folder: str | Path, out: str | Path | None = None, *, overwrite: bool = False) -> RolloutsView:
    """Write the ``.rrd`` of a rollout folder (see the module docstring).

    Args:
        folder: the rollout folder.
        out: the ``.rrd`` path or a folder (default ``rollouts_<folder name>.rrd`` in the current folder).
        overwrite: replace an existing output.

    Raises:
        ViewError: no ``rollouts.json``, a JSON file that is not a list of records, a trace that
            breaks the contract, or the output exists.
    """
    import rerun as rr
    import rerun.blueprint as rrb
    from scipy.spatial.transform import Rotation

    folder = Path(folder)
    main = folder / "rollouts.json"
    if not main.is_file():
        raise ViewError("no rollouts.json here (a rollout folder was expected)", folder, code="bad_rollouts")
    records: dict[str, list[dict]] = {}
    for p in [main, *sorted(folder.glob("rollouts_*.json"))]:
        data = _load_json(p)
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ViewError("expected a JSON list of rollout records", p, code="bad_rollouts")
        records["policy" if p == main else p.stem.removeprefix("rollouts_")] = data
    closed = folder / "closed_loop.json"
    closed_loop = _load_json(closed) if closed.is_file() else None
    traces = sorted(((int(m.group(1)), p) for p in folder.glob("trace_*.npz")
                     if (m := re.fullmatch(r"trace_(-?\d+)\.npz", p.name))), key=lambda sp: sp[0])
    by_seed = {r.get("seed"): r for r in records["policy"]}
    path = output_path(out, f"rollouts_{folder.name}.rrd")
    first = traces[0][0] if traces else None
    blueprint = rrb.Blueprint(rrb.Horizontal(
        rrb.Vertical(rrb.Spatial3DView(origin="world", name="3-D"),
                     rrb.Horizontal(rrb.Spatial2DView(origin=f"cameras/seed_{first}/wrist", name="wrist"),
                                    rrb.Spatial2DView(origin=f"cameras/seed_{first}/scene", name="scene"))),
        rrb.Vertical(rrb.TimeSeriesView(origin="opening", name="gripper opening"),
                     rrb.TextLogView(origin="outcome", name="outcome"),
                     rrb.TextDocumentView(origin="summary", name="summary")),
    ), collapse_panels=True)
    with rrd_writer(path, f"rollouts_{folder.name}", blueprint=blueprint, overwrite=overwrite) as rec:
        rec.log("world", rr.ViewCoordinates.RIGHT_HAND_Z_UP, static=True)
        rec.log("summary", rr.TextDocument(_summary(records, closed_loop), media_type=rr.MediaType.MARKDOWN),
                static=True)
        for seed, p in traces:
            tr = load_trace(p)
            t_ns = np.round(tr["t_s"] * 1e9).astype(np.int64)
            index = [rr.TimeColumn(TIME, duration=durations(t_ns))]
            base = f"world/seed_{seed}"
            rec.log(f"{base}/tcp", rr.TransformAxes3D(0.05), static=True)
            rec.send_columns(f"{base}/tcp", indexes=index, columns=rr.Transform3D.columns(
                translation=tr["tcp_pos"], quaternion=Rotation.from_rotvec(tr["tcp_rotvec"]).as_quat()))
            rec.log(f"{base}/track", rr.LineStrips3D([tr["tcp_pos"]], radii=[0.002]), static=True)
            rec.send_columns(f"{base}/target", indexes=index,
                             columns=rr.Points3D.columns(positions=tr["target_pos"]).partition([1] * len(t_ns)))
            rec.send_columns(f"opening/seed_{seed}", indexes=index, columns=rr.Scalars.columns(scalars=tr["opening"]))
            for i, t in enumerate(tr["frame_t_s"]):
                rec.set_time(TIME, duration=np.timedelta64(int(round(t * 1e9)), "ns"))
                rec.log(f"cameras/seed_{seed}/wrist", rr.Image(tr["wrist"][i]))
                rec.log(f"cameras/seed_{seed}/scene", rr.Image(tr["scene"][i]))
            r = by_seed.get(seed)
            rec.set_time(TIME, duration=np.timedelta64(int(t_ns[-1]), "ns"))
            if r is None:
                text, level = f"seed {seed}: no record in rollouts.json", "WARN"
            elif r.get("success"):
                text, level = f"seed {seed}: success after {r.get('time_to_success_s')} s", "INFO"
            else:
                text, level = f"seed {seed}: failed ({r.get('failure_mode')})", "ERROR"
            rec.log(f"outcome/seed_{seed}", rr.TextLog(text, level=level))
    return RolloutsView(path, folder, {k: len(v) for k, v in records.items()}, [s for s, _ in traces])
