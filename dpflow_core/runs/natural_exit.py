"""Natural exit: did a finished run stop because it reached its configured end?

Takes a server and a run's :class:`~dpflow_core.runs.state.RunHandle`; gives a
:class:`NaturalExitReport` (exit status, last epoch and global_step against the config, checkpoint).
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping

from dpflow_core.logs import is_finite_number
from dpflow_core.server import GpuServer
from dpflow_core.runs.monitor import describe_exit, last_error_line, read_log_records, read_output_head, read_output_tail
from dpflow_core.runs.oom import is_out_of_memory, oom_advice
from dpflow_core.runs.records import CheckpointProbe, probe_checkpoint
from dpflow_core.runs.spec import LATEST_CKPT
from dpflow_core.runs.state import RunHandle


# --------------------------------------------------------------- natural exit check


def read_run_config(server: GpuServer, run_dir: str) -> dict[str, Any] | None:
    """The resolved config the trainer saved in ``<run_dir>/.hydra/config.yaml`` (None when absent)."""
    import yaml

    path = posixpath.join(run_dir, ".hydra", "config.yaml")
    if server.size(path) is None:
        return None
    try:
        data = yaml.safe_load(server.read_text(path))
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


#: The trainer's start-up line giving the epoch's length (train/workspace logs it before the first step).
_BATCHES_PATTERN = re.compile(r"(\d+) batches per epoch")


def config_value(cfg: Mapping[str, Any] | None, dotted: str) -> Any:
    """The value at ``dotted`` (``"training.num_epochs"``) in a run's resolved config, or None when
    ``cfg`` is None or any key on the way is missing or not a mapping (never raises)."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


@dataclass(frozen=True)
class NaturalExitReport:
    """The "natural exit" check (rule 10).

    Attributes:
        passed: exit status 0 recorded by the wrapper, last logged epoch and global step
            equal to what the config asked, ``latest.ckpt`` present and loadable.
        exit_code: from the wrapper's file (None: running, or killed with the wrapper).
        running: the run has not ended yet.
        expected_epochs, last_epoch: ``training.num_epochs`` and the last logged epoch (0-based).
        batches_per_epoch: from the trainer's output, else from the first epoch's log (its
            summary line, or, for upstream-style logs without one, its distinct global steps
            once a later epoch started).
        expected_global_step, last_global_step: ``epochs x batches - 1`` and the last logged one.
        checkpoint: the probe of ``latest.ckpt``.
        problems: the evidence of each failed condition.
        oom_advice: steps to try when the output shows CUDA out of memory.
    """

    passed: bool
    exit_code: int | None
    running: bool
    expected_epochs: int | None
    last_epoch: int | None
    batches_per_epoch: int | None
    expected_global_step: int | None
    last_global_step: int | None
    checkpoint: CheckpointProbe
    problems: tuple[str, ...]
    oom_advice: tuple[str, ...] = ()
    output_tail: str = ""

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "exit": describe_exit(self.exit_code) if not self.running else "still running",
            "expected_epochs": self.expected_epochs if self.expected_epochs is not None else -1,
            "last_epoch": self.last_epoch if self.last_epoch is not None else -1,
            "batches_per_epoch": self.batches_per_epoch if self.batches_per_epoch is not None else -1,
            "expected_global_step": self.expected_global_step if self.expected_global_step is not None else -1,
            "last_global_step": self.last_global_step if self.last_global_step is not None else -1,
            "latest_ckpt": self.checkpoint.describe(),
        }
        if self.problems:
            out["problems"] = "; ".join(self.problems)
        if self.oom_advice:
            out["oom_advice"] = "\n".join(self.oom_advice)
        return out


def check_natural_exit(server: GpuServer, handle: RunHandle) -> NaturalExitReport:
    """Judge completion from the exit status, the config, the log and the checkpoint together."""
    status = server.detached_status(handle.detached)
    running = not status.finished and not status.vanished
    problems: list[str] = []
    output = read_output_tail(server, handle.output_path)
    if running:
        problems.append("the run is still running")
    elif status.exit_code is None:
        problems.append("no exit status recorded: the run was killed together with its wrapper (SIGKILL, OOM killer or reboot)")
    elif status.exit_code != 0:
        problems.append(f"{describe_exit(status.exit_code)}: {last_error_line(output)}")
    return judge_completion(server, handle, exit_code=status.exit_code, running=running, output=output, problems=problems)


def judge_completion(
    server: GpuServer, handle, *, exit_code: int | None, running: bool, output: str, problems: list[str],
) -> NaturalExitReport:
    """The trainer's own completion evidence added to ``problems`` about the exit: last logged epoch and
    global_step against the config, and ``latest.ckpt`` complete (rule 10).

    ``handle`` is a :class:`RunHandle` or any launch record with the same ``spec``, ``run_dir``,
    ``log_path``, ``output_path``, ``checkpoint_dir`` and ``gpu_ids`` (a Slurm job, a multi-host run).
    """
    cfg = read_run_config(server, handle.run_dir)
    expected_epochs = config_value(cfg, "training.num_epochs")
    if expected_epochs is None:
        expected_epochs = handle.spec.epochs
    records = read_log_records(server, handle.log_path)
    steps = [r for r in records if "global_step" in r and is_finite_number(r["global_step"])]
    last_epoch = max((int(r["epoch"]) for r in records if is_finite_number(r.get("epoch"))), default=None)
    last_step = int(steps[-1]["global_step"]) if steps else None
    bpe = None
    m = list(_BATCHES_PATTERN.finditer(output)) or list(_BATCHES_PATTERN.finditer(read_output_head(server, handle.output_path)))
    if m:
        bpe = int(m[-1].group(1))
    else:
        first = next((r for r in records if r.get("epoch_summary") and r.get("epoch") == 0), None)
        if first is not None:
            bpe = int(first["global_step"]) + 1
        elif last_epoch is not None and (last_epoch > 0 or exit_code == 0):
            # Upstream Diffusion Policy / UMI log one line per batch and nothing else: the distinct
            # global steps of a finished epoch 0 (a later one began, or the run exited 0) are its batches.
            bpe = len({int(r["global_step"]) for r in steps if r.get("epoch") == 0}) or None
    expected_step = expected_epochs * bpe - 1 if expected_epochs and bpe else None
    if expected_epochs is None:
        problems.append("cannot tell how many epochs were asked (no .hydra/config.yaml, no epochs in the spec)")
    elif last_epoch != int(expected_epochs) - 1:
        problems.append(f"last logged epoch is {last_epoch}, the config asked for {expected_epochs} (last epoch {int(expected_epochs) - 1})")
    if expected_step is not None and last_step != expected_step:
        problems.append(f"last logged global_step is {last_step}, expected {expected_step} ({expected_epochs} epochs x {bpe} batches - 1)")
    elif expected_step is None and expected_epochs is not None:
        problems.append("cannot tell the batches per epoch (neither the trainer's output nor an epoch-0 summary says)")

    probe = probe_checkpoint(server, posixpath.join(handle.checkpoint_dir, LATEST_CKPT))
    if not probe.loadable:
        problems.append(f"latest.ckpt: {probe.describe()}")
    elif probe.format == "dpflow-train-checkpoint" and expected_epochs is not None and probe.epoch != int(expected_epochs):
        problems.append(f"latest.ckpt holds epoch {probe.epoch}, the config asked for {expected_epochs}")
    advice = ()
    if is_out_of_memory(output):
        advice = tuple(oom_advice(
            handle, batch_size=config_value(cfg, "dataloader.batch_size"), val_batch_size=config_value(cfg, "val_dataloader.batch_size"),
            gradient_accumulate_every=config_value(cfg, "training.gradient_accumulate_every"),
            inventory=server.gpu_inventory() if handle.gpu_ids else None,
        ))
    return NaturalExitReport(
        passed=not problems, exit_code=exit_code, running=running,
        expected_epochs=int(expected_epochs) if expected_epochs is not None else None, last_epoch=last_epoch,
        batches_per_epoch=bpe, expected_global_step=expected_step, last_global_step=last_step, checkpoint=probe,
        problems=tuple(problems), oom_advice=advice, output_tail=output[-4000:],
    )
