"""Reading a run's ``logs.json.txt`` while it grows (``formats.md`` section 3).

The trainer appends one JSON object per line (``train_loss``, ``global_step``,
``epoch``, ``lr``; epoch summary lines add ``"epoch_summary": true`` and
validation metrics). A trailing partial line is normal while it writes, so
only complete lines (ending in ``\\n``) are parsed and the read offset stops
after the last one. Lines that are not JSON objects are counted and skipped,
never fatal: a monitor must not die on one bad line.

:class:`LogTailer` reads incrementally from a :class:`~dpflow_core.server.GpuServer`
(so the same code follows a local run and one over SSH) and keeps the
figures a monitor reports: last step, epoch and loss, steps per second, time
of the last new line (for stall detection), and the first non-finite loss.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from dpflow_core.errors import RemoteError

#: Keys whose non-finite value means the training diverged.
LOSS_KEYS = ("train_loss", "val_loss")


def _parse_line(line: str) -> dict[str, Any] | None:
    line = line.strip()
    if not line:
        return None
    try:
        # NaN / Infinity literals (Python's json.dumps writes them) parse to floats.
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def parse_log_text(text: str) -> list[dict[str, Any]]:
    """Records of every complete line of a ``logs.json.txt`` text (a trailing partial line is ignored)."""
    end = text.rfind("\n")
    if end < 0:
        return []
    return [r for r in (_parse_line(line) for line in text[: end + 1].splitlines()) if r is not None]


def is_finite_number(value: Any) -> bool:
    """True for an int or float (not bool) that is finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class LogProgress:
    """Where a run's log stands (updated by :meth:`LogTailer.poll`).

    Attributes:
        records: number of records read so far.
        bad_lines: complete lines that were not JSON objects.
        global_step, epoch: of the last record holding them (None before the first).
        train_loss: last finite-or-not per-step ``train_loss``.
        lr: last learning rate.
        last_summary: the last epoch summary record.
        first_step_time, last_line_time: ``time.monotonic()`` of the first record with a
            ``global_step`` and of the last new line (for stall detection).
        steps_per_s: global steps per second over the last polls (None until measurable).
        nonfinite: the first record whose loss was NaN or infinite (None when none).
    """

    records: int = 0
    bad_lines: int = 0
    global_step: int | None = None
    epoch: int | None = None
    train_loss: float | None = None
    lr: float | None = None
    last_summary: dict[str, Any] | None = None
    first_step_time: float | None = None
    last_line_time: float | None = None
    steps_per_s: float | None = None
    nonfinite: dict[str, Any] | None = None
    finite_losses: int = 0
    _rate_anchor: tuple[float, int] | None = field(default=None, repr=False)

    def to_metadata(self) -> dict[str, Any]:
        """Flat values for asset metadata (absent values omitted)."""
        out: dict[str, Any] = {"log_records": self.records}
        for key in ("global_step", "epoch", "train_loss", "lr", "steps_per_s"):
            value = getattr(self, key)
            if value is not None:
                out[key] = round(value, 4) if key == "steps_per_s" else value
        if self.last_summary is not None:
            for key in ("val_loss", "train_action_mse_error", "val_action_mse_error"):
                if key in self.last_summary:
                    out[f"last_epoch_{key}"] = self.last_summary[key]
        if self.bad_lines:
            out["log_bad_lines"] = self.bad_lines
        return out


class LogTailer:
    """Incremental reader of a growing ``logs.json.txt`` on a GPU server.

    Args:
        server: a :class:`~dpflow_core.server.GpuServer`.
        path: the log file on the server (it may not exist yet).
        keep_records: also keep every record in :attr:`all_records` (memory grows with the run).
        clock: the monotonic clock (replaceable in tests).
    """

    def __init__(self, server, path: str, *, keep_records: bool = False, clock=time.monotonic):
        self.server = server
        self.path = path
        self.offset = 0
        self.progress = LogProgress()
        self.keep_records = keep_records
        self.all_records: list[dict[str, Any]] = []
        self._clock = clock

    def poll(self, max_bytes: int = 4 << 20) -> list[dict[str, Any]]:
        """Read the complete lines added since the last call; return their records.

        A missing file yields nothing (the run has not started writing). A file that
        became shorter (rewritten on resume) is read again from the start.
        """
        try:
            lines, new_offset = self.server.read_lines(self.path, self.offset, max_bytes)
        except RemoteError as exc:
            if exc.code == "not_found":
                return []
            raise
        if new_offset < self.offset:
            self.progress = LogProgress()
            self.all_records = []
        self.offset = new_offset
        now = self._clock()
        records = []
        for line in lines:
            if not line.strip():
                continue
            rec = _parse_line(line)
            if rec is None:
                self.progress.bad_lines += 1
                continue
            records.append(rec)
        if lines:
            self.progress.last_line_time = now
        self._update(records, now)
        if self.keep_records:
            self.all_records.extend(records)
        return records

    def _update(self, records: list[dict[str, Any]], now: float) -> None:
        p = self.progress
        for rec in records:
            p.records += 1
            if "global_step" in rec and is_finite_number(rec["global_step"]):
                p.global_step = int(rec["global_step"])
                if p.first_step_time is None:
                    p.first_step_time = now
            if "epoch" in rec and is_finite_number(rec["epoch"]):
                p.epoch = int(rec["epoch"])
            if "lr" in rec and is_finite_number(rec["lr"]):
                p.lr = float(rec["lr"])
            if rec.get("epoch_summary"):
                p.last_summary = rec
            elif "train_loss" in rec and isinstance(rec["train_loss"], (int, float)):
                p.train_loss = float(rec["train_loss"])
                if math.isfinite(p.train_loss):
                    p.finite_losses += 1
            for key in LOSS_KEYS:
                value = rec.get(key)
                if p.nonfinite is None and isinstance(value, (int, float)) and not math.isfinite(value):
                    p.nonfinite = rec
        if p.global_step is not None:
            if p._rate_anchor is None:
                p._rate_anchor = (now, p.global_step)
            else:
                t0, s0 = p._rate_anchor
                if now - t0 >= 1.0 and p.global_step > s0:
                    p.steps_per_s = (p.global_step - s0) / (now - t0)

    def stalled(self, stall_timeout_s: float) -> bool:
        """True when no new line came for ``stall_timeout_s`` seconds after the first step."""
        p = self.progress
        if p.first_step_time is None or p.last_line_time is None:
            return False
        return self._clock() - p.last_line_time > stall_timeout_s


__all__ = ["LogProgress", "LogTailer", "is_finite_number", "parse_log_text"]
