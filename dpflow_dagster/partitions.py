"""The task partitions and what every asset of the graph shares (owners, automation).

Every asset is partitioned by ``task``, a dynamic partition per Matrix Studio
task folder: a task's whole chain (pairing, conversion, upload, runs,
checkpoint, evaluation) is one partition, so the UI shows which tasks are
converted and trained and re-runs one task alone. The partition key is the
task folder's name (checked with :func:`dpflow_core.names.validate_name`).

Where a task's recordings are (:func:`task_folder`) follows the core's rule
(:mod:`dpflow_core.pairing.tasks`), with ``root`` the configured root
(``paired_episodes`` config ``root``, else ``$DPFLOW_RECORDINGS_ROOT``, else
``<cwd>/outputs/recordings``): ``<root>/<task>``, else ``root`` itself when its name
is the task; otherwise the run fails, naming the task folders that ``root`` does hold
and where the root is configured.

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

from dpflow_core.pairing.tasks import task_folder as _core_task_folder

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


def task_folder(root: Path, task: str) -> Path:
    """The recordings folder of partition ``task`` under ``root`` (:func:`dpflow_core.pairing.tasks.task_folder`).

    Raises:
        InvalidNameError: ``task`` is not a valid task name.
        DpflowError: (code ``no_task_folder``) neither ``<root>/<task>`` nor ``root`` is that task's
            folder; the reason also says where the root is configured.
    """
    return _core_task_folder(
        root, task, hint="; set DPFLOW_RECORDINGS_ROOT or the asset's `root` config to the Matrix Studio output folder")


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
