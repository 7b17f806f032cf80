"""Live reports of a training run to whatever launched it, through installed plug-ins.

The trainer calls :func:`open_reporter` once at start; a plug-in registered under the
``dpflow.train_reporters`` entry-point group (Python packaging metadata,
https://packaging.python.org/en/latest/specifications/entry-points/) is a callable
``(total_steps, start_step) -> Reporter | None`` that returns a reporter only when its
launcher asked for one. dpflow ships one, ``dpflow_pipes.reporter:open_reporter``
(Dagster Pipes, docs/formats.md section 5); this module names no orchestrator, so the core
library stays free of Dagster, and a plain run (no plug-in answering) reports nothing.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Mapping, Protocol

#: Entry-point group of the reporter plug-ins.
REPORTER_GROUP = "dpflow.train_reporters"


class Reporter(Protocol):
    """What the trainer's main process tells a reporter (steps are global steps; epochs 0-based)."""

    def step(self, record: Mapping[str, Any], *, force: bool = False) -> None:
        """One ``logs.json.txt`` record (``global_step``, ``epoch``, ``train_loss``, ``lr``, ...)."""

    def checkpoint_saved(self, path: Path, global_step: int, epoch: int) -> None:
        """A checkpoint file was written and renamed into place."""

    def finish(self, summary: Mapping[str, Any], num_epochs: int) -> None:
        """The run completed; ``summary`` is the trainer's final record."""

    def close(self) -> None:
        """The run ends (completed or not); release the channel."""


def open_reporter(total_steps: int, start_step: int = 0) -> Reporter | None:
    """The first reporter an installed plug-in opens for this process, or None.

    ``total_steps``: the run's planned global steps; ``start_step``: the step it starts (or
    resumes) at. Plug-ins that are not wanted here return None without importing anything heavy.
    """
    for plugin in entry_points(group=REPORTER_GROUP):
        reporter = plugin.load()(total_steps, start_step)
        if reporter is not None:
            return reporter
    return None
