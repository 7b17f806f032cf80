"""Resume continuity: a run stopped and resumed must continue its logs where it stopped.

Takes a server, a smoke :class:`~dpflow_core.runs.spec.RunSpec` and the trainer; gives a
:class:`ContinuityReport` comparing the resumed run's logged losses and global_step with an
uninterrupted one (relative differences).
"""

from __future__ import annotations

import math
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dpflow_core.errors import RunError
from dpflow_core.logs import is_finite_number
from dpflow_core.names import validate_name
from dpflow_core.server.preflight import repo_state
from dpflow_core.server import GpuServer
from dpflow_core.runs.launch import launch_run
from dpflow_core.runs.monitor import describe_exit, last_error_line, read_log_records, read_output_tail
from dpflow_core.runs.processes import cleanup_run, run_processes
from dpflow_core.runs.records import probe_checkpoint
from dpflow_core.runs.smoke import list_checkpoints
from dpflow_core.runs.spec import CHECKPOINT_DIR, LATEST_CKPT, RunSpec, run_dir_for
from dpflow_core.runs.state import RunHandle, mkdir_exclusive


# ---------------------------------------------------------------- resume continuity


@dataclass(frozen=True)
class ContinuityReport:
    """The resume-continuity check (rule 11).

    An uninterrupted run saves a checkpoint after each of ``epochs`` epochs (kept as
    top-k files); a second run starts from the first epoch's checkpoint with
    ``training.resume=true`` and the same overrides. The resumed log must continue
    the uninterrupted one: the same global steps and epochs, the same learning
    rates, and losses within ``loss_rtol``.

    Attributes:
        passed: every compared record agrees.
        full_run, resumed_run: the two run names.
        resume_step: global step the resumed run started from.
        compared: records compared.
        max_loss_rel_diff, max_lr_rel_diff: the largest relative differences seen.
        mismatches: the first disagreements (``step N: key a != b``).
        commit: the training repository commit both runs used.
        problems: anything that kept the check from comparing.
    """

    passed: bool
    full_run: str
    resumed_run: str
    resume_step: int | None
    compared: int
    max_loss_rel_diff: float | None
    max_lr_rel_diff: float | None
    mismatches: tuple[str, ...]
    commit: str | None
    problems: tuple[str, ...]

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "full_run": self.full_run, "resumed_run": self.resumed_run,
            "resume_step": self.resume_step if self.resume_step is not None else -1,
            "records_compared": self.compared,
            "max_loss_rel_diff": self.max_loss_rel_diff if self.max_loss_rel_diff is not None else -1.0,
            "max_lr_rel_diff": self.max_lr_rel_diff if self.max_lr_rel_diff is not None else -1.0,
            "commit": self.commit or "",
        }
        if self.mismatches:
            out["mismatches"] = "; ".join(self.mismatches)
        if self.problems:
            out["problems"] = "; ".join(self.problems)
        return out


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


def compare_logs(
    full: Sequence[Mapping[str, Any]],
    resumed: Sequence[Mapping[str, Any]],
    resume_step: int,
    *,
    loss_rtol: float = 1e-3,
    lr_rtol: float = 1e-6,
) -> tuple[int, float, float, list[str]]:
    """Compare the resumed log with the uninterrupted one from ``resume_step`` on.

    Records are matched by (``global_step``, summary or not). A resumed record before
    ``resume_step`` is a mismatch too (a step counter that restarted).

    Returns:
        (records compared, max loss relative difference, max lr relative difference,
        mismatch descriptions).
    """
    def key(r):
        return int(r["global_step"]), bool(r.get("epoch_summary"))

    a = {key(r): r for r in full if is_finite_number(r.get("global_step")) and int(r["global_step"]) >= resume_step}
    b = {key(r): r for r in resumed if is_finite_number(r.get("global_step")) and int(r["global_step"]) >= resume_step}
    mismatches = []
    before = sorted({int(r["global_step"]) for r in resumed
                     if is_finite_number(r.get("global_step")) and int(r["global_step"]) < resume_step})
    if before:  # the restore lost the step counter (or the trainer ignored the checkpoint)
        mismatches.append(f"the resumed run logged global_step {before[0]}-{before[-1]}, before the checkpoint's "
                          f"global_step {resume_step}: its step counter did not continue")
    if set(a) != set(b):
        only_a = sorted(set(a) - set(b))[:5]
        only_b = sorted(set(b) - set(a))[:5]
        mismatches.append(f"logged steps differ: only uninterrupted {only_a}, only resumed {only_b}")
    max_loss = max_lr = 0.0
    compared = 0
    for k in sorted(set(a) & set(b)):
        ra, rb = a[k], b[k]
        compared += 1
        if ra.get("epoch") != rb.get("epoch"):
            mismatches.append(f"step {k[0]}: epoch {ra.get('epoch')} != {rb.get('epoch')}")
        for name in ("train_loss", "val_loss"):
            if name in ra or name in rb:
                va, vb = ra.get(name), rb.get(name)
                if not (is_finite_number(va) and is_finite_number(vb)):
                    mismatches.append(f"step {k[0]}: {name} {va} vs {vb}")
                    continue
                d = _rel(float(va), float(vb))
                max_loss = max(max_loss, d)
                if d > loss_rtol:
                    mismatches.append(f"step {k[0]}: {name} {va:.6g} != {vb:.6g} (rel {d:.2e})")
        if "lr" in ra or "lr" in rb:
            va, vb = ra.get("lr"), rb.get("lr")
            d = _rel(float(va), float(vb)) if is_finite_number(va) and is_finite_number(vb) else math.inf
            max_lr = max(max_lr, d)
            if d > lr_rtol:
                mismatches.append(f"step {k[0]}: lr {va} != {vb}")
    return compared, max_loss, max_lr, mismatches


def check_resume_continuity(
    server: GpuServer,
    base: RunSpec,
    *,
    epochs: int = 2,
    steps_per_epoch: int = 3,
    loss_rtol: float = 1e-3,
    timeout_s: float = 900.0,
) -> ContinuityReport:
    """Save -> resume -> continue on the same commit, compared with an uninterrupted run.

    Two runs are derived from ``base`` (its dataset, trainer, config, batch and workers):
    ``<name>-resume-full`` trains ``epochs`` epochs of ``steps_per_epoch`` batches and keeps
    every epoch's checkpoint; ``<name>-resume-cont`` gets the first epoch's checkpoint as
    its ``latest.ckpt`` and resumes to the same end. Both are released afterwards.
    """
    if epochs < 2:
        raise RunError("resume continuity needs at least 2 epochs", code="bad_config")
    ckpt_overrides = (
        "checkpoint.save_last_ckpt=true", f"checkpoint.topk.k={epochs}", "checkpoint.topk.monitor_key=train_loss",
        "checkpoint.topk.mode=min", "training.checkpoint_every=1",
    )
    common = dict(
        kind="train", dataset_path=base.dataset_path, frequency_hz=base.frequency_hz, dataset_sha256=base.dataset_sha256,
        config_name=base.config_name, epochs=epochs, max_train_steps=steps_per_epoch, max_val_steps=steps_per_epoch,
        batch_size=base.batch_size,
        num_workers=base.num_workers, num_processes=1, train_command=base.train_command, logging_mode="offline",
        save_checkpoints=True,
    )
    extra = tuple(o for o in base.extra_overrides if not o.startswith("checkpoint.")) + ckpt_overrides
    full_name = validate_name(f"{base.name}-resume-full", "run name")
    cont_name = validate_name(f"{base.name}-resume-cont", "run name")
    problems: list[str] = []

    commit_before = repo_state(server, server.config.repo_path).commit

    def finish(resume_step=None, compared=0, max_loss=None, max_lr=None, mismatches=()):
        commit_after = repo_state(server, server.config.repo_path).commit
        if commit_before != commit_after:
            problems.append(f"the repository commit changed during the check ({commit_before} -> {commit_after})")
        return ContinuityReport(
            passed=not problems and not mismatches and compared > 0, full_run=full_name, resumed_run=cont_name,
            resume_step=resume_step, compared=compared, max_loss_rel_diff=max_loss, max_lr_rel_diff=max_lr,
            mismatches=tuple(mismatches[:20]), commit=commit_before, problems=tuple(problems),
        )

    full = launch_run(server, RunSpec(name=full_name, extra_overrides=extra, **common), method="setsid", record=False)
    status = _wait_and_release(server, full, timeout_s)
    if status != 0:
        problems.append(f"uninterrupted run {full_name}: {describe_exit(status)}: {last_error_line(read_output_tail(server, full.output_path))}")
        return finish()
    names = list_checkpoints(server, full.run_dir)
    first = next((n for n in sorted(names) if re.search(r"epoch=0*0\b|epoch=0+-", n)), None)
    if first is None:
        problems.append(f"uninterrupted run kept no first-epoch checkpoint (found {names})")
        return finish()

    cont_dir = run_dir_for(server, cont_name)
    if not mkdir_exclusive(server, cont_dir):
        raise RunError("the run directory exists already", path=cont_dir, code="run_exists")
    server.mkdir(posixpath.join(cont_dir, CHECKPOINT_DIR))
    server.run(["cp", "--", posixpath.join(full.checkpoint_dir, first), posixpath.join(cont_dir, CHECKPOINT_DIR, LATEST_CKPT)], check=True)
    probe = probe_checkpoint(server, posixpath.join(cont_dir, CHECKPOINT_DIR, LATEST_CKPT))
    if not probe.loadable:
        problems.append(f"first-epoch checkpoint not loadable: {probe.describe()}")
        return finish()
    cont = launch_run(server, RunSpec(name=cont_name, resume=True, extra_overrides=extra, **common), method="setsid", record=False)
    status = _wait_and_release(server, cont, timeout_s)
    if status != 0:
        problems.append(f"resumed run {cont_name}: {describe_exit(status)}: {last_error_line(read_output_tail(server, cont.output_path))}")
        return finish()
    resume_step = probe.global_step
    full_log = read_log_records(server, full.log_path)
    cont_log = read_log_records(server, cont.log_path)
    if resume_step is None:
        resume_step = min((int(r["global_step"]) for r in cont_log if is_finite_number(r.get("global_step"))), default=0)
    compared, max_loss, max_lr, mismatches = compare_logs(full_log, cont_log, resume_step, loss_rtol=loss_rtol)
    if compared == 0:
        problems.append("the resumed run logged nothing to compare")
    return finish(resume_step, compared, max_loss, max_lr, mismatches)


def _wait_and_release(server: GpuServer, handle: RunHandle, timeout_s: float) -> int | None:
    status = server.wait_detached(handle.detached, timeout_s)
    if not status.finished:
        cleanup_run(server, handle)
    elif run_processes(server, handle):
        cleanup_run(server, handle)
    return status.exit_code
