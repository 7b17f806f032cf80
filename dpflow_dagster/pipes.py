"""Dagster Pipes over SSH: a run on the GPU server reports into the asset that launched it.

Dagster ships Pipes clients for Kubernetes, Databricks, EMR and others, none over SSH.
dpflow's GPU server is that case, and the resource already holds the Fabric connection:

- context injection: ``dg.PipesEnvContextInjector``; the bootstrap variables
  (``DAGSTER_PIPES_CONTEXT``, ``DAGSTER_PIPES_MESSAGES``) go into the run's
  environment, which the wrapper script exports with shell quoting
  (:func:`dpflow_core.runs.launch_run` ``extra_env``);
- :class:`PipesSshMessageReader`: the messages file ``<run_dir>/dpflow/pipes-<id>.jsonl``
  followed over the same connection from a byte offset
  (:class:`dpflow_core.runs.JsonLinesFollower`): the monitor loop polls it, a dropped
  connection is re-opened by the monitor and the reader goes on from its offset, so
  no message is lost or handled twice and nothing is launched again;
- :class:`LogTailReporter`: a foreign trainer (no dagster-pipes) reports through the same
  ``poll()`` interface, from ``logs.json.txt``.

Both turn a step report into the same events (:func:`report_step`): a log line and an
``AssetObservation`` of the asset with the figures as metadata, so the run's event log and
the asset's page show them while the run goes on.
"""

from __future__ import annotations

import contextlib
import uuid
from typing import Any, Iterator, Mapping

import dagster as dg

from dpflow_core.logs import LogProgress
from dpflow_core.runs import JsonLinesFollower
from dpflow_core.server import GpuServer

#: Figures of a step report shown as observation metadata (those present).
STEP_FIGURES = ("global_step", "epoch", "train_loss", "lr", "steps_per_s", "eta_s", "total_steps",
                "gpu_memory_allocated_mib", "gpu_max_memory_allocated_mib")


def messages_path(run_dir: str) -> str:
    """A fresh messages file name in the run's state folder: ``<run_dir>/dpflow/pipes-<hex12>.jsonl``."""
    return f"{run_dir.rstrip('/')}/dpflow/pipes-{uuid.uuid4().hex[:12]}.jsonl"


def report_step(context: dg.AssetExecutionContext, run_name: str, figures: Mapping[str, Any]) -> None:
    """Log one step report and record it as an ``AssetObservation`` of the asset (numbers only)."""
    meta = {k: figures[k] for k in STEP_FIGURES if isinstance(figures.get(k), (int, float))
            and not isinstance(figures.get(k), bool)}
    eta = f" ETA {meta['eta_s']:.0f} s" if "eta_s" in meta else ""
    rate = f" {meta['steps_per_s']:.2f} steps/s" if "steps_per_s" in meta else ""
    context.log.info(
        f"{run_name}: epoch {meta.get('epoch')} global_step {meta.get('global_step')} "
        f"train_loss {meta.get('train_loss')} lr {meta.get('lr')}{rate}{eta}"
    )
    context.log_event(dg.AssetObservation(
        asset_key=context.asset_key, partition=context.partition_key if context.has_partition_key else None,
        metadata={**meta, "run_name": run_name, "source": str(figures.get("source", "pipes"))},
    ))


class PipesSshMessageReader(dg.PipesMessageReader):
    """Reads a Pipes messages file on the GPU server, polled by the caller (see the module docstring).

    Args:
        context: the asset's context (step reports become its observations).
        server: the connected :class:`~dpflow_core.server.GpuServer` (local or SSH).
        path: the messages file on the server; the launched process appends to it.
        run_name: the run's name, in log lines.
    """

    def __init__(self, context: dg.AssetExecutionContext, server: GpuServer, path: str, run_name: str):
        self._context = context
        self._follower = JsonLinesFollower(server, path)
        self._handler: dg.PipesMessageHandler | None = None
        self.run_name = run_name
        self.handled = 0
        self.checkpoints: list[dict[str, Any]] = []

    @property
    def path(self) -> str:
        return self._follower.path

    @property
    def offset(self) -> int:
        return self._follower.offset

    @contextlib.contextmanager
    def read_messages(self, handler: dg.PipesMessageHandler) -> Iterator[dict[str, Any]]:
        self._handler = handler
        try:
            yield {"path": self.path}
        finally:
            self._handler = None

    def poll(self) -> int:
        """Handle the messages appended since the last poll; returns how many.

        Raises whatever the connection raises (the monitor reconnects; the offset is unchanged).
        """
        if self._handler is None:
            return 0
        messages = self._follower.poll()
        for message in messages:
            self._handler.handle_message(message)
            self.handled += 1
            if message.get("method") == "report_custom_message":
                payload = (message.get("params") or {}).get("payload") or {}
                if payload.get("kind") == "step":
                    report_step(self._context, self.run_name, payload)
                elif payload.get("kind") == "checkpoint":
                    self.checkpoints.append(payload)
                    self._context.log.info(
                        f"{self.run_name}: saved {payload.get('name')} ({payload.get('size_bytes')} bytes) "
                        f"at global_step {payload.get('global_step')}"
                    )
        return len(messages)

    @property
    def expected_writer_count(self) -> int:
        # one writer, the trainer's main process (overridden: the base method is a preview API and warns)
        return 1

    def no_messages_debug_text(self) -> str:
        return (f"Followed {self.path} on the GPU server over the resource's connection "
                f"(byte offset {self.offset}); the trainer writes it when dagster-pipes is installed there.")


class LogTailReporter:
    """A foreign trainer's step reports, from its ``logs.json.txt`` (the same ``poll()`` as the Pipes reader).

    Args:
        context: the asset's context.
        run_name: the run's name.
        every_n_steps: report every N global steps (and every epoch summary).
    """

    def __init__(self, context: dg.AssetExecutionContext, run_name: str, every_n_steps: int = 10):
        self._context = context
        self.run_name = run_name
        self.every_n_steps = max(1, int(every_n_steps))
        self._pending: list[tuple[LogProgress, list[dict[str, Any]]]] = []
        self.checkpoints: list[dict[str, Any]] = []

    def on_progress(self, progress: LogProgress, new: list[dict[str, Any]]) -> None:
        """The monitor's callback: keep the new records for the next :meth:`poll`."""
        self._pending.append((progress, new))

    def poll(self) -> int:
        """Report the step records kept since the last poll; returns how many were reported."""
        reported = 0
        pending, self._pending = self._pending, []
        for progress, records in pending:
            for rec in records:
                step = rec.get("global_step")
                if not isinstance(step, int) or not (rec.get("epoch_summary") or (step + 1) % self.every_n_steps == 0):
                    continue
                figures = {**rec, "source": "logs.json.txt"}
                if progress.steps_per_s:
                    figures["steps_per_s"] = round(progress.steps_per_s, 4)
                report_step(self._context, self.run_name, figures)
                reported += 1
        return reported


def reported_results(session: dg.PipesSession) -> tuple[dg.MaterializeResult | None, dg.AssetCheckResult | None]:
    """The materialization and the ``natural_exit`` check result the run reported (None when it did not)."""
    materialization, check = None, None
    for result in session.message_handler.get_reported_results():
        if isinstance(result, dg.MaterializeResult):
            materialization = result
        elif isinstance(result, dg.AssetCheckResult) and result.check_name == "natural_exit":
            check = result
    return materialization, check


__all__ = ["LogTailReporter", "PipesSshMessageReader", "messages_path", "reported_results", "report_step"]
