"""The closed-loop judge's settings, declared once (DESIGN rule 16): :class:`ClosedLoopSettings`.

``dpflow rollout`` makes its options from it (:func:`dpflow_core.cli.options.settings_options`), the
``rollout_evaluation`` asset's config maps onto it (:meth:`ClosedLoopSettings.from_config`), and
:func:`~dpflow_core.sim.evaluate.evaluate_closed_loop` takes it. Each field's metadata names its CLI flag, its
Dagster config field and its help (:mod:`dpflow_core.settings`). This module imports neither NumPy nor MuJoCo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dpflow_core.settings import fields_from_options, front_ends, setting

#: The baselines rolled out beside the policy on the same states: the scripted demonstrator, open-loop replay
#: of a training demonstration, and holding still (:func:`dpflow_core.sim.rollout.rollout_baseline`).
BASELINES = ("oracle", "replay", "hold")


def baselines_of(value: Any) -> tuple[str, ...]:
    """Baseline names from ``"oracle,replay"``, ``"none"`` / ``""`` (none) or a sequence of names."""
    if isinstance(value, str):
        return () if value.strip() in ("none", "") else tuple(b.strip() for b in value.split(",") if b.strip())
    return tuple(value)


@dataclass(frozen=True)
class ClosedLoopSettings:
    """The closed-loop judge's settings. Raises ValueError for a bad value, naming it.

    Attributes:
        episodes: held-out initial states, rollouts per predictor (200: the 95 % interval of an 80 %
            success is then about +-6 points; with 50 it is +-13).
        seed: which block of held-out seeds (:func:`~dpflow_core.sim.rollout.eval_seeds`).
        baselines: names from :data:`BASELINES`, rolled out on the same states (text: comma-separated or ``none``).
        target: success the policy must reach (fraction); None: the task's own
            (:data:`~dpflow_core.sim.tasks.SUCCESS_TARGET`).
        margin: by how much (absolute fraction) it must beat every non-oracle baseline.
        video_episodes: episodes filmed into ``rollouts.mp4`` and ``contact_sheet.png``.
        n_action_steps: actions executed of each predicted chunk before the policy decides again (a robot's
            deploy-time choice, UMI's steps per inference); None: the checkpoint's ``n_action_steps``. It
            does not enter training, so one checkpoint can be judged at several. Every policy of the run
            (baseline checkpoints too) executes the same number.
    """

    episodes: int = setting(200, "--episodes", "episodes", "Held-out initial states (rollouts per predictor).",
                            short="-n")
    seed: int = setting(0, "--seed", "seed", "Which block of held-out seeds (never a training seed).")
    baselines: tuple[str, ...] = setting(BASELINES, "--baselines", "baselines",
                                         "Baselines on the same states, comma-separated (oracle, replay, hold), or none.")
    target: float | None = setting(None, "--target", "target", "Success the policy must reach, a fraction (default: "
                                   "the task's own, 0.8 pick_place, 0.6 stack).")
    margin: float = setting(0.2, "--margin", "margin", "By how much (a fraction) the policy must beat each non-oracle "
                            "baseline.")
    video_episodes: int = setting(4, "--video-episodes", "video_episodes",
                                  "Episodes filmed into rollouts.mp4 and contact_sheet.png.")
    n_action_steps: int | None = setting(None, "--n-action-steps", "n_action_steps",
                                         "Actions executed of each predicted chunk before the next decision (default: "
                                         "the checkpoint's n_action_steps).")

    def __post_init__(self):
        object.__setattr__(self, "baselines", baselines_of(self.baselines))
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            raise ValueError(f"unknown baselines {unknown}: choose from {list(BASELINES)}")
        if self.episodes < 1 or self.seed < 0 or self.video_episodes < 0:
            raise ValueError(f"episodes must be >= 1, seed and video_episodes >= 0; got {self.episodes}, "
                             f"{self.seed}, {self.video_episodes}")
        if self.n_action_steps is not None and self.n_action_steps < 1:
            raise ValueError(f"n_action_steps must be >= 1 (leave it unset for the checkpoint's own), got "
                             f"{self.n_action_steps}")
        if not ((self.target is None or 0 <= self.target <= 1) and 0 <= self.margin <= 1):
            raise ValueError(f"target and margin are fractions in [0, 1], got {self.target}, {self.margin}")

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> "ClosedLoopSettings":
        """The settings from a command's parameters, named as the ``option`` flags; None takes the default."""
        return cls(**fields_from_options(cls, values))

    @classmethod
    def from_config(cls, config: Any) -> "ClosedLoopSettings":
        """The settings from the ``rollout_evaluation`` asset's Dagster config (its ``config`` fields)."""
        return cls(**{name: getattr(config, meta["config"]) for name, meta in front_ends(cls).items()})
