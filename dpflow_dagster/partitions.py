"""The task partitions and what every asset of the graph shares (owners, automation).

Every asset is partitioned by ``task``, a dynamic partition per Matrix Studio
task folder: a task's whole chain (pairing, conversion, upload, runs,
checkpoint, evaluation) is one partition, so the UI shows which tasks are
converted and trained and re-runs one task alone. The partition key is the
task folder's name (checked with :func:`dpflow_core.names.validate_name`).

Where a task's recordings are (:func:`task_folder`), with ``root`` the
configured root (``paired_episodes`` config ``root``, else
``$DPFLOW_RECORDINGS_ROOT``, else ``<cwd>/outputs/recordings``):

1. ``<root>/<task>`` when that is a folder: ``root`` is the Matrix Studio output
   root holding task folders (the usual case);
2. ``root`` itself when its name is the task: ``root`` is that task folder
   (what earlier versions took, and what ``dpflow pair ROOT`` takes);
3. otherwise the run fails, naming the task folders that ``root`` does hold.

Every asset check follows its asset's partition (:func:`task_asset_check`,
:func:`task_check_spec`): a check step loads and evaluates the materialized
partition only, and its result is recorded for that task (the Checks tab shows
the partition; each result's metadata also names the ``task``). Partitioned asset
checks are a preview API in Dagster 1.13; only that one warning is silenced.

A blocking check that fails fails its step with dpflow's reason
(:func:`fail_blocking_checks`): the check, the task and the check's description,
which is what the failed run's page shows first, in place of Dagster's
"1 blocking asset check failed with ERROR severity".

Values passed between assets are the typed results of :mod:`dpflow_core` (frozen dataclasses);
an input is declared with :func:`stage_value`, which also admits the plain dict an earlier
version stored, so an instance with old materializations keeps working.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import dagster as dg

from dpflow_core.errors import DpflowError, InvalidNameError
from dpflow_core.names import validate_name
from dpflow_core.pairing import split_name

#: One partition per Matrix Studio task folder (added by the recordings sensor, ``dpflow demo``
#: or by hand in the UI).
task_partitions = dg.DynamicPartitionsDefinition(name="task")

#: Owners shown on every asset.
OWNERS = ["team:robot-learning"]

#: Conversion (CPU work) may run by itself once its inputs are new and their blocking checks
#: passed; GPU work never gets an automation condition. Evaluated by ``conversion_automation``
#: (off by default, like every sensor of dpflow).
CONVERSION_AUTOMATION = (
    dg.AutomationCondition.eager() & dg.AutomationCondition.all_deps_blocking_checks_passed()
).with_label("eager, after blocking checks")


def recordings_root() -> Path:
    """The Matrix Studio output root: ``$DPFLOW_RECORDINGS_ROOT``, else ``<cwd>/outputs/recordings``."""
    env = os.environ.get("DPFLOW_RECORDINGS_ROOT")
    return Path(env) if env else Path.cwd() / "outputs" / "recordings"


def holds_recordings(folder: Path) -> bool:
    """Whether ``folder`` directly holds ``<STEM>.mcap`` / ``_vio.mcap`` / ``_vio.json`` files."""
    try:
        return any(split_name(p.name) is not None and p.is_file() for p in folder.iterdir())
    except OSError:
        return False


def task_folders(root: Path) -> dict[str, Path]:
    """Task name -> folder under an output root (or ``{root.name: root}`` when ``root`` is a task folder).

    Sub-folders whose names are not valid task names (:func:`validate_name`) are left out.
    """
    if holds_recordings(root):
        return {root.name: root}
    out = {}
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return {}
    for entry in entries:
        if not entry.is_dir():
            continue
        try:
            out[validate_name(entry.name, "task")] = entry
        except InvalidNameError:
            continue
    return out


def task_folder(root: Path, task: str) -> Path:
    """The recordings folder of partition ``task`` under ``root`` (rule in the module docstring).

    Raises:
        InvalidNameError: ``task`` is not a valid task name.
        DpflowError: (code ``no_task_folder``) neither ``<root>/<task>`` nor ``root`` is that task's folder.
    """
    validate_name(task, "task")
    if (root / task).is_dir():
        return root / task
    if root.name == task:
        return root
    if holds_recordings(root):
        reason = f"this is the task folder {root.name!r}, not the output root holding a task folder {task!r}"
    else:
        found = sorted(task_folders(root)) if root.is_dir() else []
        reason = (f"no task folder {task!r} here" if root.is_dir() else "no such folder") + (
            f" (task folders: {', '.join(found[:20])})" if found else ""
        ) + "; set DPFLOW_RECORDINGS_ROOT or the asset's `root` config to the Matrix Studio output folder"
    raise DpflowError(reason, root, code="no_task_folder")


@contextlib.contextmanager
def _partitioned_check_preview() -> Iterator[None]:
    """Silence Dagster's preview warning for ``partitions_def`` on an asset check, and nothing else."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message=re.escape("Specifying a partitions_def on an AssetCheckSpec"),
            category=dg.PreviewWarning,
        )
        yield


def task_check_spec(name: str, **kwargs: Any) -> dg.AssetCheckSpec:
    """``dg.AssetCheckSpec(name, **kwargs)`` partitioned like its asset (by :data:`task_partitions`)."""
    with _partitioned_check_preview():
        return dg.AssetCheckSpec(name, partitions_def=task_partitions, **kwargs)


def task_asset_check(**kwargs: Any) -> Callable[[Callable], dg.AssetChecksDefinition]:
    """``@dg.asset_check(**kwargs)`` partitioned like its asset: the check evaluates the run's task partition.

    With ``blocking=True`` a failed ERROR-severity result is recorded, then the step fails with
    :func:`fail_blocking_checks`'s reason.
    """

    def decorate(fn: Callable) -> dg.AssetChecksDefinition:
        compute = fn
        if kwargs.get("blocking"):
            @functools.wraps(fn)
            def compute(context, *args, **kw):  # a generator: the result is recorded before the step fails
                result = fn(context, *args, **kw)
                yield result
                fail_blocking_checks(context, [result])

        with _partitioned_check_preview():
            return dg.asset_check(partitions_def=task_partitions, **kwargs)(compute)

    return decorate


def fail_blocking_checks(context: dg.AssetCheckExecutionContext, results: Sequence[dg.AssetCheckResult]) -> None:
    """Fail the check step with dpflow's reason when a blocking check failed with ERROR severity.

    Call it after the results were yielded (so they are recorded). One line per failed check,
    ``blocking check <asset>:<check> failed for task <task>: <description>``, joined with "; ".

    Raises:
        dagster.Failure: with that description and metadata ``task`` and ``failed_checks``.
    """
    specs = list(context.check_specs)
    failed = []
    for index, result in enumerate(results):
        if result.passed or result.severity != dg.AssetCheckSeverity.ERROR:
            continue
        spec = next((s for s in specs if s.name == result.check_name), None) or specs[index]
        if not spec.blocking:
            continue
        asset = (result.asset_key or spec.asset_key).to_user_string()
        failed.append((f"{asset}:{spec.name}", result.description or "no description"))
    if not failed:
        return
    task = context.partition_key if context.has_partition_key else None
    where = f" for task {task}" if task else ""
    raise dg.Failure(
        description="; ".join(f"blocking check {name} failed{where}: {why}" for name, why in failed),
        metadata={**({"task": task} if task else {}), "failed_checks": ", ".join(name for name, _ in failed)},
        allow_retries=False,
    )


def check_partition_metadata(context: dg.AssetCheckExecutionContext) -> dict[str, str]:
    """``{"task": <partition key>}`` for a check result's metadata (empty when the run has no partition)."""
    return {"task": context.partition_key} if context.has_partition_key else {}


@functools.cache
def stage_value(cls: type) -> dg.DagsterType:
    """The Dagster type ``<cls>OrDict`` of an asset input holding a :class:`dpflow_core.results.StageResult` ``cls``.

    It also admits a plain ``dict``: what earlier dpflow versions stored for the same asset (and
    what a test's stand-in upstream returns); the asset reads either with ``cls.coerce``. One type
    per class (Dagster refuses two types of one name in a repository); the producing asset's output
    is annotated with ``cls`` itself, whose Dagster type Dagster names ``<cls>``.
    """
    return dg.PythonObjectDagsterType(python_type=(cls, dict), name=f"{cls.__name__}OrDict",
                                      description=f"{cls.__module__}.{cls.__name__} or its to_dict form")
