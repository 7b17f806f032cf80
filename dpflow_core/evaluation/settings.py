"""The offline evaluation's settings, declared once (DESIGN rule 16): :class:`EvaluationSettings`.

:func:`~dpflow_core.evaluation.evaluate.evaluate_checkpoint` and
:func:`~dpflow_core.evaluation.scoring.score_held_out` take it; ``dpflow evaluate`` makes its options from it
(:func:`dpflow_core.cli.options.settings_options`) and the ``evaluation`` asset's config maps onto it
(:meth:`EvaluationSettings.from_config`). Each field's metadata names its CLI flag, its Dagster config field and
its help (:mod:`dpflow_core.settings`). This module imports neither NumPy nor torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from dpflow_core.errors import RunError
from dpflow_core.settings import fields_from_options, front_ends, setting

#: How much lower than the best trivial predictor's each gated error must be (0.2: at least 20 % lower).
DEFAULT_MARGIN = 0.2


@dataclass(frozen=True)
class EvaluationSettings:
    """The offline evaluation's settings. Raises :class:`RunError` ``bad_margin`` / ``bad_config`` for a bad value.

    Attributes:
        max_samples_per_episode: at most this many chunk anchors (one per executed chunk) per held-out episode,
            evenly spaced; None: every chunk.
        plot_episodes: held-out episodes shown in the trajectory plot.
        batch_size: samples per ``predict_action`` call.
        seed: seed of the diffusion noise and of the bootstrap (the result is reproducible for a seed).
        device: torch device of the policy.
        margin: fraction in [0, 1) by which each gated error (TCP position, geodesic rotation, gripper events)
            must undercut the best trivial predictor's.
        gripper_threshold_m: width (m) of gripper open/close events; None: the middle of the training
            episodes' width range.
        command_latency_s: time (s) from the policy's answer to the controller, added to the checkpoint's camera
            latency when choosing the executed steps.
    """

    max_samples_per_episode: int | None = setting(
        48, "--samples-per-episode", "max_samples_per_episode",
        "At most this many anchors (one per executed chunk) per held-out episode, evenly spaced.")
    plot_episodes: int = setting(3, "--plot-episodes", "plot_episodes", "Held-out episodes shown in the trajectory plot.")
    batch_size: int = setting(64, "--batch-size", "batch_size", "Samples per predict_action call.")
    seed: int = setting(0, "--seed", "seed", "Seed of the diffusion noise and of the bootstrap.")
    device: str = setting("cpu", "--device", "device", "Torch device of the policy.")
    margin: float = setting(
        DEFAULT_MARGIN, "--margin", "margin",
        "How much lower than the best trivial predictor's (hold, constant velocity, mean relative action) the "
        "policy's TCP position error, rotation error and gripper event error must each be (0.2: at least 20 % lower).")
    gripper_threshold_m: float | None = setting(
        None, "--gripper-threshold", "gripper_threshold_m",
        "Width (m) of gripper open/close events (default: the middle of the training episodes' width range).")
    command_latency_s: float = setting(
        0.0, "--command-latency", "command_latency_s",
        "Seconds from the policy's answer to the controller, added to the checkpoint's camera latency.")

    def __post_init__(self):
        if not isinstance(self.margin, (int, float)) or not 0.0 <= float(self.margin) < 1.0:
            raise RunError(f"the evaluation margin must be in [0, 1), got {self.margin!r}", code="bad_margin")
        for name, least in (("max_samples_per_episode", 1), ("plot_episodes", 0), ("batch_size", 1), ("seed", 0)):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < least):
                raise RunError(f"{name} must be an integer >= {least}, got {value!r}", code="bad_config")
        for name in ("gripper_threshold_m", "command_latency_s"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0):
                raise RunError(f"{name} must be a number >= 0, got {value!r}", code="bad_config")

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> "EvaluationSettings":
        """The settings from a command's parameters, named as the ``option`` flags; None takes the default."""
        return cls(**fields_from_options(cls, values))

    @classmethod
    def from_config(cls, config: Any) -> "EvaluationSettings":
        """The settings from the ``evaluation`` asset's Dagster config (its ``config`` fields; 0 samples: every
        chunk, a negative threshold: the default)."""
        out = {name: getattr(config, meta["config"]) for name, meta in front_ends(cls).items()}
        out["max_samples_per_episode"] = out["max_samples_per_episode"] or None
        if out["gripper_threshold_m"] is not None and out["gripper_threshold_m"] < 0:
            out["gripper_threshold_m"] = None
        return cls(**out)
