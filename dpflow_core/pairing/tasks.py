"""Which folder is a task folder: the rules the CLI, the sensor and the Dagster partitions share.

Matrix Studio writes one folder per task under its output root, ``<root>/<task>/``, and the
recordings directly inside it (:mod:`dpflow_core.pairing.naming`). A folder *holds recordings*
(:func:`holds_recordings`) when a Matrix Studio file name is directly in it. Then:

- the task folders of an output root (:func:`task_folders`) are its sub-folders whose names are
  valid task names (:func:`dpflow_core.names.validate_name`), with recordings or not yet (the
  sensor watches a task folder from its creation); a root that holds recordings itself is one
  task folder, named after itself;
- the folder of task ``task`` (:func:`task_folder`) is ``<root>/<task>`` when that is a folder
  (``root`` is the output root: the usual case), else ``root`` itself when its name is the task
  (``root`` is that task folder), else there is none;
- the folder a user means by ``dpflow pair ROOT`` (:func:`resolve_task_folder`) is ``ROOT`` when
  it holds recordings, else its one sub-folder that does.
"""

from __future__ import annotations

from pathlib import Path

from dpflow_core.errors import DpflowError, InvalidNameError, PairingError
from dpflow_core.names import validate_name
from dpflow_core.pairing.naming import split_name


def holds_recordings(folder: Path) -> bool:
    """Whether ``folder`` directly holds ``<STEM>.mcap`` / ``_vio.mcap`` / ``_vio.json`` files
    (False when it cannot be listed)."""
    try:
        return any(split_name(p.name) is not None and p.is_file() for p in folder.iterdir())
    except OSError:
        return False


def task_folders(root: Path) -> dict[str, Path]:
    """Task name -> folder under an output root (or ``{root.name: root}`` when ``root`` is a task folder).

    Sub-folders whose names are not valid task names (:func:`validate_name`) are left out;
    a ``root`` that cannot be listed gives ``{}``.
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


def task_folder(root: Path, task: str, hint: str = "") -> Path:
    """The recordings folder of task ``task`` under ``root`` (the rule in the module docstring).

    Args:
        root: an output root holding task folders, or a task folder.
        task: the task name.
        hint: appended to the error's reason when ``root`` is no task folder: how to point
            at the right root (the caller knows where it was configured).

    Raises:
        InvalidNameError: ``task`` is not a valid task name.
        DpflowError: (code ``no_task_folder``) neither ``<root>/<task>`` nor ``root`` is that task's
            folder; the reason names the task folders ``root`` does hold.
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
        ) + hint
    raise DpflowError(reason, root, code="no_task_folder")


def resolve_task_folder(root: Path) -> Path:
    """``root`` when it holds recordings itself (or is no folder, or holds no task folder);
    else its one sub-folder that holds recordings.

    Raises:
        PairingError: (code ``several_task_folders``) ``root`` holds no recordings and several
            sub-folders that do (the reason names up to 20).
    """
    if not root.is_dir() or holds_recordings(root):
        return root
    tasks = [d for d in sorted(root.iterdir()) if d.is_dir() and holds_recordings(d)]
    if len(tasks) > 1:
        raise PairingError(
            f"holds no recordings itself but {len(tasks)} task folders ({', '.join(d.name for d in tasks[:20])}); "
            "give one of them", root, code="several_task_folders")
    return tasks[0] if tasks else root
