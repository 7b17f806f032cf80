"""Writing one ``.rrd``: a Rerun recording stream whose file sink writes under a temporary name.

Every view (:mod:`~dpflow_core.view.episode`, :mod:`~dpflow_core.view.dataset`,
:mod:`~dpflow_core.view.rollouts`) opens a :class:`RrdWriter`, logs through its ``rec`` (a
``rerun.RecordingStream`` of rerun-sdk, the only Rerun object the views touch), and closes it:
the stream is flushed and disconnected, so the file is complete, and only then renamed into
place (:func:`dpflow_core.files.atomic_path`). A failure leaves no ``.rrd`` behind.

Timelines shared by the views: ``time``, a duration in seconds from the start of what is shown
(an episode's earliest capture time, a dataset episode's first timestamp, a rollout's start), and,
where a step index means something, ``step`` (a sequence). Log time (when the SDK logged) is
turned off: it says nothing about the data and would add a column per row.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import numpy as np

from dpflow_core.errors import DpflowError
from dpflow_core.files import atomic_path

#: Application id of every dpflow recording (the viewer groups recordings by it).
APPLICATION_ID = "dpflow"
#: The timeline of seconds from the start of what is shown.
TIME = "time"


class ViewError(DpflowError):
    """A view cannot be written: the input is not what the view shows, or the output exists."""

    code = "view_error"


def output_path(out: str | Path | None, default_name: str) -> Path:
    """Where a view writes: ``out`` when given (a folder gets ``default_name`` inside it), else
    ``default_name`` in the current folder."""
    if out is None:
        return Path.cwd() / default_name
    out = Path(out)
    return out / default_name if out.is_dir() else out


def view_command(source: str | Path, *args: str) -> str:
    """The shell command that writes a view of ``source`` and serves it: ``dpflow view SOURCE ARGS --serve``
    (for an ``.rrd``, ``dpflow view FILE.rrd --serve`` serves that file as it is)."""
    import shlex

    return shlex.join(["dpflow", "view", str(source), *args, "--serve"])


def durations(ns: np.ndarray) -> np.ndarray:
    """(N,) int64 nanoseconds as ``timedelta64[ns]``, the exact form Rerun stores a duration in."""
    return np.asarray(ns, dtype=np.int64).astype("timedelta64[ns]")


@contextlib.contextmanager
def rrd_writer(path: str | Path, recording_name: str, *, blueprint=None, overwrite: bool = False) -> Iterator["RecordingStream"]:  # noqa: F821
    """Yield a ``rerun.RecordingStream`` saving to a temporary file beside ``path``; on leaving the
    block normally, flush and disconnect it and rename the file to ``path``.

    Args:
        path: the ``.rrd`` to write (its folder must exist).
        recording_name: the name the viewer shows for the recording (also its recording id).
        blueprint: the layout the viewer opens with (a ``rerun.blueprint.Blueprint``), or None.
        overwrite: replace an existing ``path``.

    Raises:
        ViewError: ``path`` exists and ``overwrite`` is false, or its folder does not exist.
    """
    import rerun as rr

    path = Path(path)
    if path.exists() and not overwrite:
        raise ViewError("exists; pass --overwrite to replace it", path, code="output_exists")
    if not path.parent.is_dir():
        raise ViewError("its folder does not exist", path, code="no_output_folder")
    with atomic_path(path, overwrite=overwrite, suffix=".rrd") as tmp:
        rec = rr.RecordingStream(APPLICATION_ID, recording_id=recording_name)
        rec.set_log_time_enabled(False)
        rec.save(tmp, default_blueprint=blueprint)
        rec.send_recording_name(recording_name)
        try:
            yield rec
        finally:
            rec.flush(timeout_sec=600)
            rec.disconnect()
