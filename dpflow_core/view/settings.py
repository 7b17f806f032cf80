"""What a dataset view shows, declared once: :class:`DatasetWindow` (``dpflow view DATASET.npz``'s options).

Which episode, how densely, which sample in detail, and the observation/action window (To, H and the strides,
default the trainer's) of :func:`~dpflow_core.view.dataset.view_dataset` and
:func:`~dpflow_core.view.dataset.view_predictions`. ``dpflow view`` makes its options from the fields
(:func:`dpflow_core.cli.options.settings_options`). This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dpflow_core.settings import fields_from_options, setting


@dataclass(frozen=True)
class DatasetWindow:
    """What a view of a ``dataset.npz`` shows. Raises ValueError for a negative index or a stride below 1.

    Attributes:
        episode: the dataset episode (0-based).
        every: log every K-th frame.
        anchor: the step whose training sample is shown in detail; None: the middle one.
        max_samples: with a checkpoint's predictions, at most this many evenly spaced anchors; None: every chunk.
        n_obs_steps, horizon, obs_down_sample_steps, action_down_sample_steps: the sample window (To, H and the
            strides, in dataset steps); None: the trainer's. A checkpoint's predictions use its own.
    """

    episode: int = setting(0, "--episode", "episode", "Dataset episode to show (0-based).")
    every: int = setting(1, "--every", "every", "Dataset views: log every K-th frame.")
    anchor: int | None = setting(None, "--anchor", "anchor",
                                 "Dataset views: the step whose sample is shown in detail (default: the middle one).")
    max_samples: int | None = setting(None, "--max-samples", "max_samples",
                                      "--predict: at most this many evenly spaced anchors.")
    n_obs_steps: int | None = setting(None, "--n-obs-steps", "n_obs_steps", "Dataset views: To (default: the trainer's).")
    horizon: int | None = setting(None, "--horizon", "horizon", "Dataset views: H (default: the trainer's).")
    obs_down_sample_steps: int | None = setting(None, "--obs-down-sample-steps", "obs_down_sample_steps",
                                                "Dataset views: observation stride.")
    action_down_sample_steps: int | None = setting(None, "--action-down-sample-steps", "action_down_sample_steps",
                                                   "Dataset views: action stride.")

    def __post_init__(self):
        if self.episode < 0 or self.every < 1 or (self.anchor is not None and self.anchor < 0) or \
                (self.max_samples is not None and self.max_samples < 1):
            raise ValueError(f"episode and anchor must be >= 0, every and max_samples >= 1; got {self.episode}, "
                             f"{self.anchor}, {self.every}, {self.max_samples}")

    def window(self) -> dict[str, int]:
        """The sample-window fields that were given (for :class:`~dpflow_core.train.data.ObsActionSpec`)."""
        names = ("n_obs_steps", "horizon", "obs_down_sample_steps", "action_down_sample_steps")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> "DatasetWindow":
        """The window from a command's parameters, named as the ``option`` flags; None takes the default."""
        return cls(**fields_from_options(cls, values))
