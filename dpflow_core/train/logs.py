"""``logs.json.txt``: one JSON object per line, appended while training runs.

Step lines hold exactly ``train_loss``, ``global_step`` (0-based index of the
batch), ``epoch`` (0-based), ``lr`` and ``data_time_s`` (seconds the step waited
for its batch: loading, collation and the copy to the device; not reproducible,
so resume comparisons leave it out). At the end of each epoch a summary line
adds ``"epoch_summary": true``, the epoch's mean ``train_loss`` over all
processes and, when computed, ``val_loss``, ``train_action_mse_error`` and
``val_action_mse_error``; its ``global_step`` is the epoch's last batch.

A trailing partial line is normal while a run writes; :func:`read_json_log`
skips it. On resume, lines from work the checkpoint does not contain (steps
at or after its ``global_step``) are dropped, so the file always tells one
consistent history.

:class:`WandbRun` is the same run's Weights & Biases log (main process only).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dpflow_core.files import write_text_atomic

if TYPE_CHECKING:
    from omegaconf import DictConfig


def read_json_log(path: str | Path) -> list[dict[str, Any]]:
    """Parse every complete line of a ``logs.json.txt`` (a trailing partial line is skipped).

    Raises:
        FileNotFoundError: when the file does not exist.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                records.append(obj)
    return records


class JsonLinesLogger:
    """Appends records to ``logs.json.txt``, one flushed line each.

    Args:
        path: the log file.
        keep_before_step: when given (resume), first rewrite the file (atomically)
            keeping only complete records with ``global_step`` below this value.
    """

    def __init__(self, path: str | Path, keep_before_step: int | None = None):
        self.path = Path(path)
        self.dropped = 0
        if keep_before_step is not None and self.path.exists():
            records = read_json_log(self.path)
            kept = [r for r in records if int(r.get("global_step", -1)) < keep_before_step]
            self.dropped = len(records) - len(kept)
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a", encoding="utf-8")

    def log(self, record: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(dict(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class WandbRun:
    """Main-process W&B run; imported only when ``logging.mode`` is not ``disabled``."""

    def __init__(self, cfg: DictConfig, run_dir: Path, run_id: str | None, resolved: dict[str, Any]):
        import wandb

        self._wandb = wandb
        self.id = run_id or uuid.uuid4().hex[:8]
        wandb_dir = os.environ.get("WANDB_DIR") or str(run_dir)
        Path(wandb_dir).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            dir=wandb_dir,
            project=str(cfg.logging.project),
            name=cfg.logging.name or run_dir.name,
            group=cfg.logging.group,
            tags=list(cfg.logging.tags or []),
            mode=str(cfg.logging.mode),
            id=self.id,
            resume="allow",
            config=resolved,
            settings=wandb.Settings(console="off", x_disable_stats=True),
        )

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self.run.log(dict(data), step=step)

    def finish(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)
