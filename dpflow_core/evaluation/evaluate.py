"""The evaluation of a checkpoint on its held-out episodes, the result and its gate (see the package docstring)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.results import StageResult
from dpflow_core.evaluation.metrics import ACTION_GROUPS, DIMENSION_NAMES
from dpflow_core.evaluation.scoring import GATE_BASELINES, PREDICTORS, HeldOutScores, score_held_out
from dpflow_core.evaluation.settings import EvaluationSettings
from dpflow_core.evaluation.plots import plot_errors_per_step, plot_loss_curve, plot_trajectories, read_loss_curve

if TYPE_CHECKING:
    from dpflow_core.replay_buffer import ReplayBuffer

log = logging.getLogger("dpflow_core.evaluation")

#: Fewest held-out episodes an evaluation accepts.
MIN_HELD_OUT_EPISODES = 2

RESULT_NAME = "evaluation.json"
TRAJECTORY_PLOT = "trajectories.png"
ERROR_PLOT = "errors_per_step.png"
LOSS_PLOT = "loss_curve.png"

def held_out_split(cfg, n_episodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_mask, held_out_mask) over the episodes, as the trainer split them.

    Uses the checkpoint config's ``task.val_ratio``, ``task.val_min_episodes`` (1 when
    absent, as older checkpoints trained) and ``task.split_seed`` with
    :func:`dpflow_core.train.data.split_episodes`.

    Raises:
        RunError: ``no_held_out_episodes`` when the dataset has fewer than 2 episodes or the
            training held out none (``task.val_ratio`` 0); ``too_few_held_out_episodes`` when
            fewer than :data:`MIN_HELD_OUT_EPISODES` were held out. Evaluating on training
            episodes, or on one episode, would say nothing about generalisation.
    """
    from omegaconf import OmegaConf

    from dpflow_core.train.data import split_episodes

    ratio = float(OmegaConf.select(cfg, "task.val_ratio", default=0.0) or 0.0)
    minimum = int(OmegaConf.select(cfg, "task.val_min_episodes", default=1) or 1)
    seed = int(OmegaConf.select(cfg, "task.split_seed", default=0) or 0)
    if n_episodes < 2:
        raise RunError(
            f"evaluation needs held-out episodes: the dataset has {n_episodes} episode(s), so every one was "
            f"used for training; record at least {MIN_HELD_OUT_EPISODES + 1} episodes",
            code="no_held_out_episodes",
        )
    if ratio <= 0:
        raise RunError(
            "evaluation needs held-out episodes: the checkpoint's training held out none (task.val_ratio=0); "
            "train with task.val_ratio > 0",
            code="no_held_out_episodes",
        )
    train_mask, val_mask = split_episodes(n_episodes, ratio, seed, min_val_episodes=minimum)
    if val_mask.sum() < MIN_HELD_OUT_EPISODES:
        raise RunError(
            f"evaluation needs at least {MIN_HELD_OUT_EPISODES} held-out episodes; the checkpoint's training held "
            f"out {int(val_mask.sum())} of {n_episodes} (task.val_ratio={ratio}, task.val_min_episodes={minimum}): "
            f"record more episodes or train with task.val_min_episodes={MIN_HELD_OUT_EPISODES}",
            code="too_few_held_out_episodes",
        )
    return train_mask, val_mask


def predict_absolute_actions(policy, buffer, rows: np.ndarray, *, batch_size: int, seed: int) -> np.ndarray:
    """The policy's ABSOLUTE action predictions at sample rows of ``buffer``: ``(N, H, 7)`` float64.

    This is the one function between the evaluation and the policy: everything else scores
    ``[pos m, rotvec rad, width m]`` per horizon step. It is
    :meth:`dpflow_core.inference.Policy.predict_samples`, which cuts the observations as training
    did and undoes the pose representation and normalisation (what a robot runs).

    Args:
        policy: a :class:`dpflow_core.inference.Policy` (:func:`dpflow_core.inference.load_policy`).
        buffer: the replay buffer; rows: ``(N, 3)`` ``(anchor, episode_start, episode_end)``.
        batch_size: samples per network call; seed: seed of the diffusion noise.

    Raises:
        RunError: when ``policy`` is not an inference policy.
    """
    if not hasattr(policy, "predict_samples"):
        raise RunError("evaluation needs a dpflow_core.inference.Policy (load_policy)", code="action_representation")
    return policy.predict_samples(buffer, rows, batch_size=batch_size, seed=seed)


def recorded_dataset_sha256(payload: Mapping[str, Any], checkpoint_path: str | Path) -> tuple[str | None, str | None]:
    """The training dataset's SHA-256 recorded with a checkpoint, and where it was found.

    Looks in the checkpoint's ``dataset.sha256`` entry (written by the trainer), then in
    the run record (``run_record.json``) that :func:`dpflow_core.checkpoints.download_checkpoint`
    puts beside a downloaded checkpoint.

    Returns:
        ``(sha256 hex or None, "checkpoint" | "<record path>" | None)``.
    """
    from dpflow_core.checkpoints import RECORD_FILE

    digest = (payload.get("dataset") or {}).get("sha256")
    if digest:
        return str(digest), "checkpoint"
    record = Path(checkpoint_path).parent / RECORD_FILE
    if record.is_file():
        try:
            digest = (json.loads(record.read_text()).get("dataset") or {}).get("sha256")
        except (OSError, ValueError):
            digest = None
        if digest:
            return str(digest), str(record)
    return None, None


# Result ---------------------------------------------------------------------------------------


def evaluation_dir_for(checkpoint_dir: str | Path) -> Path:
    """A new folder for one evaluation of the checkpoint in ``checkpoint_dir``:
    ``<checkpoint_dir>/evaluation/<UTC time, YYYYmmddTHHMMSSZ>`` (not created here)."""
    from datetime import datetime, timezone

    return Path(checkpoint_dir) / "evaluation" / datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


@dataclass(frozen=True)
class EvaluationResult(StageResult):
    """What :func:`evaluate_checkpoint` measured; the value of the ``evaluation`` asset.

    Attributes:
        checkpoint_path, dataset_path: the inputs.
        dataset_sha256: SHA-256 of the evaluated dataset; recorded_dataset_sha256: the one recorded
            with the checkpoint (equal, or the evaluation was refused; None when none was recorded).
        held_out_episodes: indices of the held-out (validation) episodes.
        n_episodes: held-out episodes that gave samples; train_episodes: training episodes (the
            mean relative action's source).
        n_samples: anchors evaluated (one per executed chunk).
        horizon: actions per prediction; step_s: seconds between them.
        dimension_names: the 7 dimensions (``position.x``, ..., ``gripper.width``).
        metrics: per predictor (:data:`PREDICTORS`), its :class:`PredictorMetrics` as a dict, on the
            executed steps.
        gripper_threshold_m: width threshold of the open/close events (m).
        margin: how much lower than the best baseline's each gated error must be (0.2 = 20 %).
        trajectory_plot, error_plot, loss_plot: PNG files (loss_plot None without a log file).
        out_dir: where the PNGs and ``evaluation.json`` were written.
        seconds: wall-clock duration.
        notes: how the evaluation went, where it matters (no dataset SHA-256 recorded, non-finite predictions, no log).
        checkpoint_sha256: SHA-256 of the evaluated checkpoint, when the caller knew it.
        gate: per gated criterion (:data:`~dpflow_core.evaluation.gate.CRITERIA`) its figures, verdict
            and bootstrap intervals (:func:`~dpflow_core.evaluation.gate.gate_criteria`); empty in a
            result stored before the gate had criteria, which never passes.
        executed_steps: the horizon steps scored; latency_s: the latency they were chosen for (s);
            n_action_steps: actions a robot executes per chunk.
        mean_relative_action: ``(H, 7)`` the mean relative action ``[pos m, rotvec rad, width change m]``.

    ``to_dict`` adds ``beats_baseline`` and the reported MSEs (``*_mse``); ``from_dict`` reads
    ``to_dict``'s form, ignoring those derived figures.
    """

    checkpoint_path: str
    dataset_path: str
    dataset_sha256: str
    recorded_dataset_sha256: str | None
    held_out_episodes: tuple[int, ...]
    n_episodes: int
    train_episodes: int
    n_samples: int
    horizon: int
    step_s: float
    dimension_names: tuple[str, ...]
    metrics: dict[str, dict[str, Any]]
    gripper_threshold_m: float
    margin: float
    trajectory_plot: str
    error_plot: str
    loss_plot: str | None
    out_dir: str
    seconds: float
    notes: tuple[str, ...] = field(default=())
    checkpoint_sha256: str | None = None
    gate: dict[str, dict[str, Any]] = field(default_factory=dict)
    executed_steps: tuple[int, ...] = ()
    latency_s: float = 0.0
    n_action_steps: int = 0
    mean_relative_action: tuple[tuple[float, ...], ...] = ()

    def mse(self, predictor: str) -> float:
        """Overall 7-D MSE of one predictor (mixed units: reported, not gated)."""
        return float(self.metrics[predictor]["mse"])

    @property
    def policy_mse(self) -> float:
        return self.mse("policy")

    @property
    def beats_baseline(self) -> bool:
        """True when every gated criterion passed (and there are criteria)."""
        return bool(self.gate) and all(bool(c["passed"]) for c in self.gate.values())

    @property
    def failed_criteria(self) -> tuple[str, ...]:
        """The gated criteria that did not pass."""
        return tuple(name for name, c in self.gate.items() if not c["passed"])

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serialisable form, with ``beats_baseline`` and the reported ``*_mse``."""
        data = super().to_dict()
        data.update(beats_baseline=self.beats_baseline, **{f"{name}_mse": self.mse(name) for name in self.metrics})
        return data

    def gate_table(self) -> str:
        """A Markdown table of the gate: one row per criterion."""
        rows = ["| criterion | policy (95 % CI) | hold | constant velocity | mean relative | required | improvement (95 % CI) | |",
                "|---|---|---|---|---|---|---|---|"]
        for name, c in self.gate.items():
            lo, hi = c["policy_ci95"]
            ilo, ihi = c["improvement_ci95"]
            base = " | ".join(f"{c['baselines'][b]:.4g}" + (" (best)" if b == c["best_baseline"] else "") for b in GATE_BASELINES)
            better = ">" if name == "gripper_events" else "<"
            rows.append(
                f"| {name} ({c['unit']}) | {c['policy']:.4g} ({lo:.3g} to {hi:.3g}) | {base} | {better} {c['required']:.4g} | "
                f"{c['improvement']:.1%} ({ilo:.1%} to {ihi:.1%}) | {'PASS' if c['passed'] else 'FAIL'} |"
            )
        return "\n".join(rows)

    def markdown_table(self) -> str:
        """The gate table, then a Markdown table of every metric: one column per predictor."""
        names = [p for p in PREDICTORS if p in self.metrics]
        rows = [self.gate_table(), "", "| metric | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]

        def row(label: str, values: Sequence[float], fmt: str = "{:.6g}") -> None:
            rows.append(f"| {label} | " + " | ".join(fmt.format(v) for v in values) + " |")

        m = self.metrics
        row("position error (m)", [m[p]["position_error_m"] for p in names])
        row("rotation error (rad)", [m[p]["rotation_error_rad"] for p in names])
        rows.append(
            "| gripper events matched / recorded (false) | "
            + " | ".join(f"{m[p]['gripper_events_matched']}/{m[p]['gripper_events']} ({m[p]['gripper_events_false']})" for p in names)
            + " |"
        )
        row("gripper error (m)", [m[p]["gripper_error_m"] for p in names])
        row("gripper event timing error (s)", [m[p]["gripper_timing_error_s"] for p in names], "{:.3g}")
        row("MSE, mixed units (not gated)", [m[p]["mse"] for p in names])
        for name, _ in ACTION_GROUPS:
            row(f"MSE {name}", [m[p]["mse_per_key"][name] for p in names])
        for k, step in enumerate(self.executed_steps):
            row(f"position error step {step} (m)", [m[p]["position_error_m_per_step"][k] for p in names])
        return "\n".join(rows)

    def verdict(self) -> str:
        """One line: each criterion's policy figure against what it had to beat, and the samples."""
        parts = []
        for name, c in self.gate.items():
            better = ">" if name == "gripper_events" else "<"
            parts.append(
                f"{name} {c['policy']:.4g} vs required {better} {c['required']:.4g} ({c['best_baseline']} {c['baseline']:.4g}) "
                f"{'PASS' if c['passed'] else 'FAIL'}"
            )
        return (
            "; ".join(parts or ["no gate figures"]) + f"; margin {self.margin:.0%}; executed steps "
            f"{list(self.executed_steps)} of {self.horizon}; {self.n_samples} samples from {self.n_episodes} held-out episodes"
        )


# Evaluation --------------------------------------------------------------------------------------


def evaluate_checkpoint(
    checkpoint_path: str | Path,
    dataset_path: str | Path,
    out_dir: str | Path,
    settings: EvaluationSettings | None = None,
    *,
    log_path: str | Path | None = None,
    overwrite: bool = False,
) -> EvaluationResult:
    """Evaluate the checkpoint's EMA policy against the trivial baselines on the held-out episodes.

    Args:
        checkpoint_path: a trainer checkpoint (``latest.ckpt`` or a top-k file).
        dataset_path: the ``dataset.npz`` the checkpoint was trained on (checked by SHA-256
            when one is recorded, else by its episode and step counts).
        out_dir: folder for ``evaluation.json`` and the PNGs (created; existing results
            are kept unless ``overwrite``).
        log_path: the run's ``logs.json.txt`` for the loss curve (optional).
        settings: :class:`~dpflow_core.evaluation.settings.EvaluationSettings` (default: its defaults): anchors
            per held-out episode, plotted episodes, batch size, seed, device, margin, gripper event threshold and
            command latency.
        overwrite: replace an existing ``evaluation.json`` in ``out_dir``.

    Returns:
        EvaluationResult (``beats_baseline`` is the gate).

    Raises:
        RunError: unreadable checkpoint, fewer than 2 held-out episodes, a policy whose action
            is not absolute, existing results, a margin outside [0, 1), a latency that leaves no
            executed step.
        DatasetError: the dataset differs from the one the checkpoint was trained on (SHA-256,
            both named; or episode/step counts), lacks a pose key, or its held-out episodes give
            no sample.
    """
    import torch

    from dpflow_core.files import write_text_atomic
    from dpflow_core.inference import load_policy

    started = time.monotonic()
    settings = settings or EvaluationSettings()
    seed, batch_size = settings.seed, settings.batch_size
    out_dir = Path(out_dir)
    result_path = out_dir / RESULT_NAME
    if result_path.exists() and not overwrite:
        raise RunError("evaluation results exist already (pass --overwrite (overwrite=True from Python) to replace them)", path=result_path, code="exists")

    buffer, actual_sha, recorded_sha, notes = _open_training_dataset(checkpoint_path, dataset_path)
    policy = load_policy(checkpoint_path, device=settings.device, use_ema=True)
    cfg, spec = policy.cfg, policy.spec
    train_mask, val_mask = held_out_split(cfg, buffer.n_episodes)
    held_out = tuple(int(e) for e in np.flatnonzero(val_mask))
    latency_s = policy.camera_obs_latency_s + float(settings.command_latency_s)

    def predict(rows: np.ndarray) -> np.ndarray:
        return predict_absolute_actions(policy, buffer, rows, batch_size=batch_size, seed=seed)

    torch.manual_seed(seed)
    try:
        scores = score_held_out(
            predict, buffer, spec, train_mask, val_mask, frequency_hz=buffer.frequency_hz,
            n_action_steps=int(policy.network.n_action_steps), latency_s=latency_s, settings=settings,
        )
    except ValueError as exc:
        raise RunError(str(exc), path=checkpoint_path, code="bad_latency") from exc
    if not np.isfinite(scores.predictions["policy"]).all():
        notes.append("the policy predicted non-finite actions")
    no_events = scores.gate["gripper_events"]["events"] == 0
    if no_events:
        notes.append("no gripper event in the executed steps of the held-out episodes: the gripper criterion "
                     "passes only a policy that invents none")

    out_dir.mkdir(parents=True, exist_ok=True)
    index_rows = scores.rows
    trajectory_plot, error_plot, loss_plot = _plot_results(
        buffer, held_out, scores, settings.plot_episodes, out_dir, log_path, checkpoint_path, notes)

    result = EvaluationResult(
        checkpoint_path=str(Path(checkpoint_path).resolve()),
        dataset_path=str(buffer.path),
        dataset_sha256=actual_sha,
        recorded_dataset_sha256=recorded_sha,
        held_out_episodes=held_out,
        n_episodes=int(len(np.unique(index_rows[:, 1]))),
        train_episodes=int(train_mask.sum()),
        n_samples=int(len(index_rows)),
        horizon=int(spec.horizon),
        step_s=scores.step_s,
        dimension_names=DIMENSION_NAMES,
        metrics={name: asdict(m) for name, m in scores.metrics.items()},
        gripper_threshold_m=scores.gripper_threshold_m,
        margin=float(settings.margin),
        trajectory_plot=str(trajectory_plot),
        error_plot=str(error_plot),
        loss_plot=loss_plot,
        out_dir=str(out_dir.resolve()),
        seconds=time.monotonic() - started,
        notes=tuple(notes),
        gate=scores.gate,
        executed_steps=tuple(int(k) for k in scores.steps),
        latency_s=float(latency_s),
        n_action_steps=int(policy.network.n_action_steps),
        mean_relative_action=tuple(tuple(float(v) for v in r) for r in scores.mean_relative),
    )
    write_text_atomic(result_path, json.dumps(result.to_dict(), indent=2) + "\n", overwrite=overwrite)
    log.info("evaluation of %s: %s", checkpoint_path, result.verdict())
    return result


def _open_training_dataset(checkpoint_path: str | Path, dataset_path: str | Path) -> tuple[ReplayBuffer, str, str | None, list[str]]:
    """The dataset, opened, once it is known to be the one the checkpoint was trained on.

    Returns (buffer, its SHA-256, the SHA-256 the checkpoint recorded or None, notes).
    Raises DatasetError ``dataset_mismatch`` (see :func:`evaluate_checkpoint`).
    """
    from dpflow_core.files import sha256_file
    from dpflow_core.replay_buffer import ReplayBuffer
    from dpflow_core.train.checkpoint import load_checkpoint

    payload = load_checkpoint(checkpoint_path, require_complete=False)
    trained_on = dict(payload.get("dataset") or {})
    recorded_sha, sha_source = recorded_dataset_sha256(payload, checkpoint_path)
    del payload
    buffer = ReplayBuffer(dataset_path)
    notes: list[str] = []
    actual_sha = sha256_file(buffer.path)
    if recorded_sha is not None and recorded_sha != actual_sha:
        raise DatasetError(
            f"SHA-256 is {actual_sha} but the checkpoint was trained on a dataset with SHA-256 {recorded_sha} "
            f"(recorded in {sha_source}; trained on {trained_on.get('path')}): evaluate on the training dataset",
            path=buffer.path,
            code="dataset_mismatch",
        )
    if recorded_sha is None:
        notes.append("no dataset SHA-256 recorded with the checkpoint: only episode and step counts were compared")
    for key, actual in (("n_episodes", buffer.n_episodes), ("n_steps", buffer.n_steps)):
        if key in trained_on and int(trained_on[key]) != int(actual):
            raise DatasetError(
                f"the checkpoint was trained on a dataset with {key}={trained_on[key]} "
                f"({trained_on.get('path')}), this one has {actual}: the held-out split would differ",
                path=buffer.path,
                code="dataset_mismatch",
            )
    return buffer, actual_sha, recorded_sha, notes


def _plot_results(
    buffer: ReplayBuffer, held_out: Sequence[int], scores: HeldOutScores, plot_episodes: int, out_dir: Path,
    log_path: str | Path | None, checkpoint_path: str | Path, notes: list[str],
) -> tuple[Path, Path, str | None]:
    """The trajectory, error-per-step and (with a log) loss plots in ``out_dir``: their paths
    (the loss plot's None without a log; a missing log is added to ``notes``)."""
    index_rows = scores.rows
    shown = list(held_out[: max(1, plot_episodes)])
    episode_rows = {}
    for ep in shown:
        mask = index_rows[:, 1] == buffer.episode_slice(ep).start
        episode_rows[ep] = (index_rows[mask, 0], {name: p[mask] for name, p in scores.predictions.items()})
    shown = [ep for ep in shown if len(episode_rows[ep][0])]
    trajectory_plot = plot_trajectories(buffer, shown, episode_rows, scores.step_s, out_dir / TRAJECTORY_PLOT, scores.steps)
    error_plot = plot_errors_per_step(scores.metrics, scores.step_s, out_dir / ERROR_PLOT, scores.steps)

    loss_plot = None
    if log_path is not None and Path(log_path).is_file():
        loss_plot = str(plot_loss_curve(read_loss_curve(log_path), out_dir / LOSS_PLOT, title=f"training loss ({Path(checkpoint_path).name})"))
    elif log_path is not None:
        notes.append(f"no training log at {log_path}: no loss curve")
    return trajectory_plot, error_plot, loss_plot
