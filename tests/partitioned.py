"""Materialize task-partitioned assets in tests: the partition is added to the instance first."""

from __future__ import annotations

import dagster as dg

from dpflow_dagster.partitions import task_partitions


def add_task(instance: dg.DagsterInstance, task: str) -> None:
    """Add the ``task`` dynamic partition when the instance does not have it yet."""
    if not instance.has_dynamic_partition(task_partitions.name, task):
        instance.add_dynamic_partitions(task_partitions.name, [task])


def materialize(assets, task: str, instance: dg.DagsterInstance | None = None, **kwargs) -> dg.ExecuteInJobResult:
    """``dg.materialize`` of ``assets`` for partition ``task`` (an ephemeral instance unless one is given)."""
    instance = instance or dg.DagsterInstance.ephemeral()
    add_task(instance, task)
    return dg.materialize(assets, partition_key=task, instance=instance, **kwargs)
