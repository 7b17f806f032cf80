"""The trainer's reports to Dagster through ``dagster-pipes``, when Dagster launched it that way.

Dagster Pipes (https://docs.dagster.io/guides/build/external-pipelines) passes a
launched process its context and where to write messages in two environment
variables, ``DAGSTER_PIPES_CONTEXT`` and ``DAGSTER_PIPES_MESSAGES``. When both
are set, :func:`open_reporter` opens the standalone ``dagster-pipes`` package
(imported here only, lazily: plain ``python -m dpflow_core.train`` never imports
it, and a server without it trains as before, saying so once on stderr) and
the main process reports, as one JSON message per line appended to the file
that ``DAGSTER_PIPES_MESSAGES`` names (docs/formats.md, section 5):

- ``log``: the trainer's own log lines (the ``dpflow_core.train`` logger);
- ``report_custom_message`` ``{"kind": "step", ...}`` every ``report_every_n_steps``
  global steps (a Pipes extra, default 10) and at each epoch's end: ``global_step``,
  ``epoch``, ``train_loss``, ``lr``, ``steps_per_s``, ``eta_s``, ``total_steps`` and, with
  CUDA, ``gpu_memory_allocated_mib`` / ``gpu_max_memory_allocated_mib``;
- ``report_custom_message`` ``{"kind": "checkpoint", "path", "name", "size_bytes", "global_step", "epoch"}``
  after each checkpoint file is written (renamed into place);
- at the end of a completed run, ``report_asset_materialization`` (metadata: epoch,
  global_step, train_loss, latest.ckpt path and SHA-256, which is also the data version)
  and ``report_asset_check`` ``natural_exit`` (the configured epochs reached, latest.ckpt
  present and loadable); the orchestrator adds the exit status, which only it can see.

Every other process of a multi-process run reports nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping

#: The variables Dagster Pipes sets (dagster_pipes.DAGSTER_PIPES_CONTEXT_ENV_VAR / _MESSAGES_ENV_VAR).
CONTEXT_ENV = "DAGSTER_PIPES_CONTEXT"
MESSAGES_ENV = "DAGSTER_PIPES_MESSAGES"
#: Default of the Pipes extra ``report_every_n_steps``.
DEFAULT_EVERY_N_STEPS = 10

log = logging.getLogger(__name__)


def launched_by_pipes(environ: Mapping[str, str] = os.environ) -> bool:
    """True when Dagster Pipes set both bootstrap variables for this process."""
    return bool(environ.get(CONTEXT_ENV)) and bool(environ.get(MESSAGES_ENV))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class _PipesLogHandler(logging.Handler):
    def __init__(self, pipes):
        super().__init__(logging.INFO)
        self._pipes = pipes

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = "warning" if record.levelno >= logging.WARNING else "info"
            getattr(self._pipes.log, level)(record.getMessage())
        except Exception:  # a report must never stop training
            self.handleError(record)


class PipesReporter:
    """Reports of one training process (see the module docstring); every method is a no-op when closed.

    Args:
        pipes: an open ``dagster_pipes.PipesContext``.
        total_steps: global steps the run will have made at its end (for the ETA).
        start_step: the global step the run starts from (resume: the checkpoint's).
    """

    def __init__(self, pipes, total_steps: int, start_step: int = 0):
        self._pipes = pipes
        self.every_n_steps = max(1, int(pipes.get_extra("report_every_n_steps") if "report_every_n_steps" in pipes.extras
                                        else DEFAULT_EVERY_N_STEPS))
        self.total_steps = int(total_steps)
        self._anchor = (time.monotonic(), int(start_step))
        self._handler = _PipesLogHandler(pipes)
        logging.getLogger("dpflow_core.train").addHandler(self._handler)

    def step(self, record: Mapping[str, Any], *, force: bool = False) -> None:
        """Report a ``logs.json.txt`` step record when its ``global_step + 1`` is a multiple of N (or ``force``)."""
        step = int(record["global_step"])
        if not force and (step + 1) % self.every_n_steps:
            return
        t0, s0 = self._anchor
        elapsed = time.monotonic() - t0
        rate = (step + 1 - s0) / elapsed if elapsed > 0 and step + 1 > s0 else None
        payload: dict[str, Any] = {
            "kind": "step", "global_step": step, "epoch": int(record["epoch"]),
            "train_loss": float(record["train_loss"]), "lr": float(record["lr"]), "total_steps": self.total_steps,
        }
        if rate:
            payload["steps_per_s"] = round(rate, 4)
            payload["eta_s"] = round(max(0, self.total_steps - step - 1) / rate, 1)
        payload.update(_cuda_memory())
        self._pipes.report_custom_message(payload)

    def checkpoint_saved(self, path: Path, global_step: int, epoch: int) -> None:
        """Report a checkpoint file written (already renamed to its final name)."""
        self._pipes.report_custom_message({
            "kind": "checkpoint", "path": str(path), "name": path.name, "size_bytes": path.stat().st_size,
            "global_step": int(global_step), "epoch": int(epoch),
        })

    def finish(self, summary: Mapping[str, Any], num_epochs: int) -> None:
        """Report the materialization and the in-run ``natural_exit`` check of a run that completed its loop."""
        latest = summary.get("latest_checkpoint")
        metrics = dict(summary.get("metrics") or {})
        metadata: dict[str, Any] = {
            "epoch": int(summary["epoch"]), "global_step": int(summary["global_step"]),
            "configured_epochs": int(num_epochs),
            **{k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)},
        }
        data_version = None
        problems = []
        if int(summary["epoch"]) != int(num_epochs):
            problems.append(f"stopped at epoch {summary['epoch']} of {num_epochs}")
        if latest:
            from dpflow_core.train.checkpoint import load_checkpoint

            data_version = _sha256(Path(latest))
            metadata["latest_ckpt"] = {"raw_value": latest, "type": "path"}
            metadata["latest_ckpt_sha256"] = data_version
            try:
                load_checkpoint(latest)
            except Exception as exc:  # reported, then judged by the orchestrator
                problems.append(f"latest.ckpt does not load: {exc}")
        else:
            problems.append("no latest.ckpt was written")
        self._pipes.report_asset_materialization(metadata=metadata, data_version=data_version)
        self._pipes.report_asset_check(
            check_name="natural_exit", passed=not problems, severity="ERROR",
            metadata={"reported_from_run": True, "problems": "; ".join(problems) or "none",
                      "epoch": int(summary["epoch"]), "global_step": int(summary["global_step"])},
        )

    def close(self) -> None:
        """Write the Pipes ``closed`` message and detach from the trainer's logger."""
        logging.getLogger("dpflow_core.train").removeHandler(self._handler)
        self._pipes.close()


def _cuda_memory() -> dict[str, float]:
    try:
        import torch

        if not torch.cuda.is_available():
            return {}
        return {"gpu_memory_allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
                "gpu_max_memory_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1)}
    except Exception:
        return {}


def open_reporter(total_steps: int, start_step: int = 0) -> PipesReporter | None:
    """A :class:`PipesReporter` when Dagster Pipes launched this process, else None (nothing imported).

    The ``dpflow.train_reporters`` plug-in that :func:`dpflow_core.train.reporting.open_reporter` calls.

    A Pipes launch on a server without the ``dagster-pipes`` package trains anyway and prints one
    ``warning:`` line to stderr; the orchestrator then follows ``logs.json.txt`` alone.
    """
    if not launched_by_pipes():
        return None
    try:
        from dagster_pipes import open_dagster_pipes
    except ImportError:
        print("warning: launched by Dagster Pipes but dagster-pipes is not installed here: no live reports",
              file=sys.stderr, flush=True)
        return None
    return PipesReporter(open_dagster_pipes(), total_steps, start_step)
