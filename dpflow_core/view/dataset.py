"""What training sees, in Rerun: one episode of a ``dataset.npz``, its samples, and a policy's chunks.

:func:`view_dataset` shows one episode's aligned rows on the timelines ``step`` (the row's index
in the episode) and ``time`` (its ``timestamp``, s from the episode start; ``step / frequency``
when the buffer has no timestamp):

    world/gripper                 Transform3D of ``robot0_eef_pos`` / ``robot0_eef_rot_axis_angle``
    world/track                   the episode's positions as one line strip (static)
    world/action_chunk            at each sample anchor, the positions of its action chunk
                                  (:func:`~dpflow_core.train.data.action_positions`)
    rows/<key>                    each low-dimensional key, per row (Scalars)
    frames/<rgb key>              the frames, every ``every``-th row
    anchor/obs/<rgb key>/<k>      for the chosen anchor: the To frames of the observation window
                                  (:func:`~dpflow_core.train.data.obs_positions`, nearest row), static
    world/anchor/obs_positions    the window's positions, interpolated as the sampler does (static)
    world/anchor/action_chunk     the anchor's action chunk (static); ``anchor`` a TextDocument
                                  with the rows each element reads

Anchors are those of :func:`~dpflow_core.train.data.sequence_index` for this episode, so a view
shows exactly the samples training draws. :func:`view_predictions` adds a checkpoint's predicted
chunks (:func:`dpflow_core.inference.predict_dataset`) against the recorded ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpflow_core.view.rrd import TIME, ViewError, durations, output_path, rrd_writer

STEP = "step"


@dataclass(frozen=True)
class DatasetView:
    """What :func:`view_dataset` / :func:`view_predictions` wrote.

    Attributes:
        path: the ``.rrd``. source: the ``dataset.npz``. episode: the episode shown.
        rows: rows of the episode; frames: frames logged per rgb key (every ``every``-th row).
        anchors: ``(N, 3)`` int64 ``(anchor, episode_start, episode_end)`` buffer rows of its samples.
        anchor: the chosen anchor's buffer row (None when the episode gives no sample).
        predicted: for :func:`view_predictions`, ``(N, H, 7)`` float64 predicted actions; else None.
    """

    path: Path
    source: Path
    episode: int
    rows: int
    frames: int
    anchors: np.ndarray
    anchor: int | None
    predicted: np.ndarray | None = None


def _open(npz: str | Path, episode: int):
    from dpflow_core.replay_buffer import ReplayBuffer

    buffer = ReplayBuffer(npz, required=())
    if not 0 <= episode < buffer.n_episodes:
        raise ViewError(f"episode {episode} out of range: the dataset has {buffer.n_episodes} episodes", npz,
                        code="bad_episode")
    return buffer


def _times(buffer, sl: slice) -> np.ndarray:
    """(n,) int64 ns from the episode start of each row."""
    if "timestamp" in buffer:
        t = np.asarray(buffer["timestamp"][sl], dtype=np.float64)
        return np.round((t - t[0]) * 1e9).astype(np.int64)
    return np.round(np.arange(sl.stop - sl.start) / buffer.frequency_hz * 1e9).astype(np.int64)


def _quat(rotvec: np.ndarray) -> np.ndarray:
    from scipy.spatial.transform import Rotation

    return Rotation.from_rotvec(np.asarray(rotvec, dtype=np.float64).reshape(-1, 3)).as_quat()


def _set_row(rec, step: int, t_ns: int) -> None:
    rec.set_time(STEP, sequence=int(step))
    rec.set_time(TIME, duration=np.timedelta64(int(t_ns), "ns"))


def _log_episode(rec, buffer, sl: slice, t_ns: np.ndarray, every: int, rgb_keys) -> int:
    """Rows, track and frames of one episode; returns the frames logged per rgb key."""
    import rerun as rr

    from dpflow_core.train.data import POS_KEY, ROT_KEY

    steps = np.arange(sl.stop - sl.start)
    index = [rr.TimeColumn(STEP, sequence=steps), rr.TimeColumn(TIME, duration=durations(t_ns))]
    pos = np.asarray(buffer[POS_KEY][sl], dtype=np.float64)
    rec.log("world", rr.ViewCoordinates.RIGHT_HAND_Z_UP, static=True)
    rec.log("world/gripper", rr.TransformAxes3D(0.05), static=True)
    rec.log("world/track", rr.LineStrips3D([pos], radii=[0.002]), static=True)
    if ROT_KEY in buffer:
        rec.send_columns("world/gripper", indexes=index, columns=rr.Transform3D.columns(
            translation=pos, quaternion=_quat(buffer[ROT_KEY][sl])))
    for key in buffer:
        arr = buffer[key]
        if key == "timestamp" or arr.ndim != 2 or arr.dtype.kind != "f":
            continue
        rec.send_columns(f"rows/{key}", indexes=index,
                         columns=rr.Scalars.columns(scalars=np.asarray(arr[sl], dtype=np.float64)))
    frames = 0
    for key in rgb_keys:
        if key not in buffer:
            continue
        frames = 0
        for i in range(0, len(steps), every):
            _set_row(rec, i, t_ns[i])
            rec.log(f"frames/{key}", rr.Image(np.asarray(buffer[key][sl.start + i])))
            frames += 1
    return frames


def _blueprint(rgb_keys, extra=()):
    import rerun.blueprint as rrb

    return rrb.Blueprint(rrb.Horizontal(
        rrb.Vertical(rrb.Spatial3DView(origin="world", name="3-D"),
                     *[rrb.Spatial2DView(origin=f"frames/{k}", name=k) for k in rgb_keys]),
        rrb.Vertical(rrb.TimeSeriesView(origin="rows", name="rows"), *extra,
                     rrb.Spatial2DView(origin="anchor/obs", name="observation window"),
                     rrb.TextDocumentView(origin="anchor", name="anchor")),
    ), collapse_panels=True)


def dataset_view_name(npz: str | Path, episode: int) -> str:
    """``<folder>_<stem>_episode<N>``: a dataset episode's view named after the dataset's folder and file
    stem, so that two datasets (each usually ``dataset.npz`` in a folder of its own) do not collide."""
    npz = Path(npz).absolute()
    return f"{npz.parent.name + '_' if npz.parent.name else ''}{npz.stem}_episode{episode}"


def checkpoint_view_name(checkpoint: str | Path) -> str:
    """``<run>_<stem>``: a checkpoint named after its run and its file stem, so that the predictions of two runs'
    ``latest.ckpt`` do not collide: ``run_a_latest`` for a run folder's ``run_a/checkpoints/latest.ckpt``, and
    ``run_a_1541c446_latest`` for one downloaded by ``dpflow checkpoint`` (``<root>/run_a/<sha16>/latest.ckpt``:
    the run, then the first 8 hex digits of the hash folder)."""
    ckpt = Path(checkpoint).absolute()
    parent = ckpt.parent
    if parent.name == "checkpoints":
        return f"{parent.parent.name + '_' if parent.parent.name else ''}{ckpt.stem}"
    if re.fullmatch(r"[0-9a-f]{16}", parent.name) and parent.parent.name:
        return f"{parent.parent.name}_{parent.name[:8]}_{ckpt.stem}"
    return f"{parent.name + '_' if parent.name else ''}{ckpt.stem}"


def view_dataset(npz: str | Path, out: str | Path | None = None, *, episode: int = 0, every: int = 1,
                 anchor: int | None = None, spec=None, overwrite: bool = False) -> DatasetView:
    """Write the ``.rrd`` of one dataset episode as training samples it (see the module docstring).

    Args:
        npz: the ``dataset.npz``.
        out: the ``.rrd`` path or a folder for :func:`dataset_view_name` ``.rrd`` (default: the current folder).
        episode: the episode (0-based).
        every: log every ``every``-th frame (the rows are all logged).
        anchor: the step in the episode whose observation window and chunk are shown in detail;
            default the middle sample.
        spec: the :class:`~dpflow_core.train.data.ObsActionSpec` that cuts samples (default: its defaults).
        overwrite: replace an existing output.

    Raises:
        DatasetError: the file is no valid replay buffer.
        ViewError: ``episode`` out of range, ``every`` < 1, ``anchor`` not a sample anchor of
            the episode, or the output exists.
    """
    from dpflow_core.train.data import ObsActionSpec

    spec = spec or ObsActionSpec()
    if every < 1:
        raise ViewError(f"--every must be >= 1, got {every}")
    buffer = _open(npz, episode)
    name = dataset_view_name(npz, episode)
    path = output_path(out, f"{name}.rrd")
    rgb = [k for k in spec.rgb_keys if k in buffer]
    with rrd_writer(path, name, blueprint=_blueprint(rgb), overwrite=overwrite) as rec:
        sl, t_ns, frames, rows, chosen = _episode_and_samples(rec, buffer, episode, every, spec, anchor)
    return DatasetView(path, Path(npz), episode, sl.stop - sl.start, frames, rows, chosen)


def _episode_and_samples(rec, buffer, episode: int, every: int, spec, anchor: int | None):
    import rerun as rr

    from dpflow_core.train.data import POS_KEY, action_positions, interpolate, obs_positions, sequence_index

    sl = buffer.episode_slice(episode)
    t_ns = _times(buffer, sl)
    frames = _log_episode(rec, buffer, sl, t_ns, every, spec.rgb_keys)
    mask = np.zeros(buffer.n_episodes, dtype=bool)
    mask[episode] = True
    rows = sequence_index(buffer.episode_ends, mask, spec)
    if len(rows) == 0:
        rec.log("anchor", rr.TextDocument(f"episode {episode} gives no sample: shorter than "
                                          f"{spec.min_episode_length} rows"), static=True)
        return sl, t_ns, frames, rows, None
    pos = np.asarray(buffer[POS_KEY], dtype=np.float64)
    chunks = action_positions(spec, rows)  # (N, H) buffer rows
    for (a, _s, _e), chunk in zip(rows, chunks):
        _set_row(rec, a - sl.start, t_ns[a - sl.start])
        rec.log("world/action_chunk", rr.LineStrips3D([pos[chunk]], radii=[0.003], colors=[[255, 160, 0]]))
    if anchor is None:
        k = len(rows) // 2
    else:
        hit = np.flatnonzero(rows[:, 0] == sl.start + int(anchor))
        if not len(hit):
            raise ViewError(f"step {anchor} is no sample anchor of episode {episode} (anchors: steps 0.."
                            f"{rows[-1, 0] - sl.start})", buffer.path, code="bad_anchor")
        k = int(hit[0])
    row = rows[k : k + 1]
    lines = [f"# anchor: step {row[0, 0] - sl.start} of episode {episode} (buffer row {row[0, 0]})", "",
             "| element | buffer rows (fractional: interpolated) |", "|---|---|"]
    for key in spec.obs_keys:
        if key not in buffer:
            continue
        at = obs_positions(spec, key, row)[0]
        lines.append(f"| obs {key} | {', '.join(f'{p:g}' for p in at)} |")
        if key in spec.rgb_keys:
            for j, p in enumerate(np.rint(at).astype(np.int64)):
                rec.log(f"anchor/obs/{key}/{j}", rr.Image(np.asarray(buffer[key][p])), static=True)
        elif key == POS_KEY:
            rec.log("world/anchor/obs_positions", rr.Points3D(interpolate(pos, at), radii=[0.006],
                                                               colors=[[0, 200, 255]]), static=True)
    lines.append(f"| action | {', '.join(str(int(i)) for i in chunks[k])} |")
    rec.log("world/anchor/action_chunk", rr.LineStrips3D([pos[chunks[k]]], radii=[0.004], colors=[[255, 60, 0]]),
            static=True)
    rec.log("anchor", rr.TextDocument("\n".join(lines), media_type=rr.MediaType.MARKDOWN), static=True)
    return sl, t_ns, frames, rows, int(row[0, 0])


def view_predictions(checkpoint: str | Path, npz: str | Path, out: str | Path | None = None, *, episode: int = 0,
                     every: int = 1, max_samples: int | None = None, device: str = "cpu", seed: int = 0,
                     overwrite: bool = False) -> DatasetView:
    """Write the ``.rrd`` of a checkpoint's predicted action chunks against the recorded ones.

    The episode is shown as by :func:`view_dataset` (with the checkpoint's spec); at each predicted
    anchor's time, ``world/predicted_chunk`` and ``world/recorded_chunk`` (positions, m) and the
    scalars ``prediction/position_error_m`` (mean distance over the horizon) and
    ``prediction/gripper_error_m`` (mean absolute width error).

    Args:
        checkpoint: the trainer checkpoint (:func:`dpflow_core.inference.load_policy`).
        npz, out, episode, every, overwrite: as :func:`view_dataset`.
        max_samples: predict at most this many evenly spaced anchors (None: all).
        device: torch device. seed: the diffusion noise seed.

    Raises:
        RunError: the checkpoint cannot be loaded. DatasetError, ViewError: as :func:`view_dataset`.
    """
    import rerun as rr
    import rerun.blueprint as rrb

    from dpflow_core.inference import load_policy, predict_dataset

    if every < 1:
        raise ViewError(f"--every must be >= 1, got {every}")
    buffer = _open(npz, episode)
    policy = load_policy(checkpoint, device=device)
    pred = predict_dataset(policy, buffer, episodes=[episode], max_samples=max_samples, seed=seed)
    name = f"{dataset_view_name(npz, episode)}_{checkpoint_view_name(checkpoint)}"
    path = output_path(out, f"{name}.rrd")
    rgb = [k for k in policy.spec.rgb_keys if k in buffer]
    extra = (rrb.TimeSeriesView(origin="prediction", name="prediction error"),)
    with rrd_writer(path, name, blueprint=_blueprint(rgb, extra), overwrite=overwrite) as rec:
        sl, t_ns, frames, rows, chosen = _episode_and_samples(rec, buffer, episode, every, policy.spec, None)
        for a, p, r in zip(pred.rows[:, 0], pred.predicted, pred.recorded):
            _set_row(rec, a - sl.start, t_ns[a - sl.start])
            rec.log("world/predicted_chunk", rr.LineStrips3D([p[:, :3]], radii=[0.003], colors=[[40, 120, 255]]))
            rec.log("world/recorded_chunk", rr.LineStrips3D([r[:, :3]], radii=[0.003], colors=[[255, 160, 0]]))
            rec.log("prediction/position_error_m", rr.Scalars(float(np.linalg.norm(p[:, :3] - r[:, :3], axis=1).mean())))
            rec.log("prediction/gripper_error_m", rr.Scalars(float(np.abs(p[:, 6] - r[:, 6]).mean())))
    return DatasetView(path, Path(npz), episode, sl.stop - sl.start, frames, rows, chosen, pred.predicted)
