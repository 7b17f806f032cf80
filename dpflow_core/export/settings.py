"""The settings of a LeRobot export, declared once (DESIGN rule 16): every option that decides the export's content.

:class:`ExportSettings` holds what a person chooses about an export (task text, action rule, frame size,
rotation, LeRobot format, how invalid poses and off-rate episodes are handled), with defaults, units and
validation. :func:`~dpflow_core.export.export.export_lerobot`, :func:`~dpflow_core.export.export.export_key`
and :func:`~dpflow_core.export.export.lerobot_path_in` take it; ``dpflow export-lerobot`` makes its options from
it (:func:`dpflow_core.cli.options.settings_options`) and the ``lerobot_dataset`` asset maps its config onto it
(:meth:`ExportSettings.from_config`). Each field's metadata names its CLI flag, its Dagster config field and its
help (:mod:`dpflow_core.settings`); a test fails when one is missing.

What does not change an export's bytes is an argument of ``export_lerobot``, not a setting: worker processes,
reuse of an existing export, progress, hash verification. The topics are the pairing manifest's; the video
encoder is a :class:`~dpflow_core.export.video.VideoSpec`.

This module imports neither NumPy nor the export's writers, so that the command line's help costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dpflow_core.conversion.settings import INVALID_POSE_POLICIES, RATE_POLICIES
from dpflow_core.errors import ConversionError
from dpflow_core.export import FORMATS, V30_VERSION
from dpflow_core.settings import fields_from_options, front_ends, setting

#: How the end-effector rotation is written in the state and the action: ``rotvec`` (3, a rotation
#: vector; what the dataset.npz holds) or ``rot6d`` (6, continuous, so that ``action - state`` per
#: element, the relative actions of lerobot and openpi, stays meaningful near +-pi).
ROTATIONS = ("rotvec", "rot6d")
#: ``next_state``: action[t] = state[t+1]; ``delta``: position and gripper differences
#: state[t+1] - state[t] and the rotation R[t+1] R[t]^-1 as a rotation vector (world
#: frame). The last frame holds: its action is its own state (``next_state``) or zero (``delta``).
ACTION_RULES = ("next_state", "delta")


def parse_image_size(value: Any) -> tuple[int, int] | None:
    """``"W,H"`` (or ``"WxH"``), a pair of ints, or ``"native"`` / ``""`` / None (the camera's resolution: None).

    Raises:
        ConversionError: ``bad_option`` for anything else.
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("native", "")):
        return None
    try:
        w, h = (int(v) for v in (value.lower().replace("x", ",").split(",") if isinstance(value, str) else value))
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"image size must be 'W,H' or 'native', got {value!r}", code="bad_option") from exc
    return w, h


@dataclass(frozen=True)
class ExportSettings:
    """What decides a LeRobot export's content. Raises :class:`ConversionError` ``bad_option`` for a bad value.

    Attributes:
        task_text: the task text of every episode; None: the manifest's task (the task folder's name).
        action_rule: one of :data:`ACTION_RULES`.
        image_size: (W, H) of the videos in pixels, even numbers; None keeps the camera's size.
        invalid_pose_policy, min_overlap_fraction: as the conversion's
            (:class:`~dpflow_core.conversion.settings.ConversionSettings`).
        frequency_tolerance: relative tolerance of an episode's rate against its task's.
        rate_policy: an episode at another rate than its task's: ``resample``, ``group`` (a dataset of its own
            beside the output, ``<out_dir>-<rate>hz``) or ``reject``.
        codebase_version: the LeRobot format, one of :data:`~dpflow_core.export.FORMATS`.
        rotation: one of :data:`ROTATIONS`.
    """

    task_text: str | None = setting(None, "--task-text", "task_text",
                                    "Task text of every episode (default: the task folder's name).")
    action_rule: str = setting("next_state", "--action-rule", "action_rule",
                               "next_state (action = next state) | delta (state differences).")
    image_size: tuple[int, int] | None = setting(None, "--image-size", "image_size",
                                                 "Video frame size W,H (even numbers) or native.", cli=(str, "native"))
    invalid_pose_policy: str = setting("trim", "--invalid-pose-policy", "invalid_pose_policy",
                                       "trim | reject (pose_valid == false stretches).")
    min_overlap_fraction: float = setting(0.5, "--min-overlap-fraction", "min_overlap_fraction",
                                          "Least fraction of the camera's span the poses must cover.")
    frequency_tolerance: float = setting(0.05, "--frequency-tolerance", "frequency_tolerance",
                                         "Relative tolerance of an episode's rate against its task's.")
    rate_policy: str = setting(
        "resample", "--rate-policy", "rate_policy",
        "An episode at another rate than its task's: 'resample' it to the task's rate (images held, poses "
        "interpolated), 'group' (a dataset of its own beside the output, <output>-<rate>hz) or 'reject'.")
    codebase_version: str = setting(V30_VERSION, "--format", "format",
                                    "LeRobot format: v3.0 (lerobot >= 0.4) | v2.1 (lerobot 0.3, openpi).")
    rotation: str = setting("rotvec", "--rotation", "rotation",
                            "rotvec: 7-D state/action | rot6d: 10-D, for relative (action - state) actions.")

    def __post_init__(self):
        choices = {"action_rule": (ACTION_RULES, "action rule"), "codebase_version": (FORMATS, "LeRobot format"),
                   "rotation": (ROTATIONS, "rotation"), "rate_policy": (RATE_POLICIES, "rate_policy"),
                   "invalid_pose_policy": (INVALID_POSE_POLICIES, "invalid_pose_policy")}
        for name, (allowed, what) in choices.items():
            if getattr(self, name) not in allowed:
                raise ConversionError(f"unknown {what} {getattr(self, name)!r}; use one of {', '.join(allowed)}",
                                      code="bad_option")
        size = parse_image_size(self.image_size)
        if size is not None and (size[0] % 2 or size[1] % 2 or min(size) < 2):
            raise ConversionError(f"image size {size[0]}x{size[1]} must be even (H.264 yuv420p)", code="bad_option")
        object.__setattr__(self, "image_size", size)
        for name in ("min_overlap_fraction", "frequency_tolerance"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise ConversionError(f"{name} must be a fraction in [0, 1], got {value!r}", code="bad_option")

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> "ExportSettings":
        """The settings from a command's parameters, named as the ``option`` flags (``--format`` -> ``format``);
        a parameter left out, or None, takes the default."""
        return cls(**fields_from_options(cls, values))

    @classmethod
    def from_config(cls, config: Any) -> "ExportSettings":
        """The settings from the ``lerobot_dataset`` asset's Dagster config (its ``config`` fields)."""
        return cls(**{name: getattr(config, meta["config"]) for name, meta in front_ends(cls).items()})
