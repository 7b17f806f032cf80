"""The settings of a conversion, declared once (DESIGN rule 16): every option that decides a dataset's content.

:class:`ConversionSettings` holds what a person chooses about a conversion (image size, how invalid poses,
camera holes, short episodes, off-rate episodes and implausible sensor data are handled), with its
defaults, units and validation. :func:`~dpflow_core.conversion.dataset_npz.convert`,
:func:`~dpflow_core.conversion.align.align_episode`, the alignment jobs and the dataset key take it;
``dpflow convert`` and the ``dataset_npz`` asset only map their options onto it.

The mapping is declared here, once, in each field's metadata (:func:`front_ends`):

* ``option``: the command-line flag of ``dpflow convert``;
* ``config``: the field of the ``dataset_npz`` asset's Dagster config (a tuple when the setting is spread
  over several: the image size is ``image_width`` and ``image_height``);
* ``help``: what the setting means, in one sentence (the Dagster description and the CLI help).

A test reads this metadata and fails when a field lacks its option or its config field, or when a front
end's default or help differs from the one declared here.

What does not change a dataset's bytes is not a setting but an argument of ``convert``: worker processes,
backup, reuse of an existing dataset, the per-episode cache, progress, hash verification. Nor are the
topic names: they are the pairing manifest's (what the episodes were paired with).

This module imports neither NumPy nor the decoding stack, so that reading it costs nothing; the
plausibility options are imported when a value is built.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from dpflow_core.errors import ConversionError
from dpflow_core.settings import fields_from_options, front_ends, setting  # noqa: F401 (front_ends: re-exported for the front ends)

if TYPE_CHECKING:
    from dpflow_core.recordings.plausibility import PlausibilityOptions

INVALID_POSE_POLICIES = ("trim", "reject")
GAP_POLICIES = ("split", "reject")
#: What an episode at another rate than its task's gets (:mod:`dpflow_core.conversion.rates`).
RATE_POLICIES = ("resample", "group", "reject")
#: What an episode shorter than the minimum episode length (``min_segment_frames``) gets, whole or a piece.
SHORT_EPISODE_POLICIES = ("reject", "warn")
#: Frame size (W, H) in pixels of a dataset when none is chosen.
DEFAULT_IMAGE_SIZE = (224, 224)
#: Camera intervals longer than this (seconds) are never bridged by interpolation.
DEFAULT_MAX_GAP_S = 0.5
#: Shortest segment kept when an episode is split at a gap: (action_horizon - 1) x
#: down_sample_steps + 1 frames with the UMI defaults (16, 3), the least that yields a
#: training sample (formats.md section 2).
DEFAULT_MIN_SEGMENT_FRAMES = 46


def check_image_size(image_size: Sequence[int]) -> tuple[int, int]:
    """``image_size`` as ``(W, H)`` pixels; :class:`ConversionError` ``bad_option`` unless two ints 8-8192."""
    try:
        w, h = (int(v) for v in image_size)
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"image size must be (W, H), got {image_size!r}", code="bad_option") from exc
    if not (8 <= w <= 8192 and 8 <= h <= 8192):
        raise ConversionError(f"image size {w}x{h} out of range (8..8192 pixels per side)", code="bad_option")
    return w, h


def image_size_of(text: str) -> tuple[int, int]:
    """``"W,H"`` or ``"WxH"`` -> (W, H) in pixels, unchecked (:func:`check_image_size` checks the range).

    Raises:
        ConversionError: ``bad_option`` when the text is not two integers.
    """
    try:
        w, h = (int(v) for v in text.lower().replace("x", ",").split(","))
    except ValueError as exc:
        raise ConversionError(f"--image-size must be W,H (e.g. 224,224), got {text!r}", code="bad_option") from exc
    return w, h


def plausibility_of(value: Any) -> "PlausibilityOptions":
    """Validated plausibility options, every class's policy filled in, from None (the defaults), a dict of their
    fields (``to_dict`` form), its JSON text, or a :class:`~dpflow_core.recordings.plausibility.PlausibilityOptions`.

    Raises:
        ConversionError: ``bad_option`` for text that is not a JSON object, an unknown field, class or policy.
    """
    from dpflow_core.recordings.plausibility import PlausibilityOptions

    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else None
        except json.JSONDecodeError as exc:
            raise ConversionError(f"plausibility options must be a JSON object, got {value!r}: {exc}",
                                  code="bad_option") from exc
    try:
        if not isinstance(value, PlausibilityOptions):
            if value is not None and not isinstance(value, Mapping):
                raise TypeError(f"expected a mapping of PlausibilityOptions fields, got {value!r}")
            value = PlausibilityOptions.from_dict(dict(value) if value else None)
        # every policy filled in: equal options compare equal, however they were given
        return PlausibilityOptions.from_dict(value.validate().to_dict())
    except (TypeError, ValueError) as exc:
        raise ConversionError(f"plausibility options: {exc}", code="bad_option") from exc


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConversionError(f"{name} must be one of {allowed}, got {value!r}", code="bad_option")


@dataclass(frozen=True)
class ConversionSettings:
    """What decides a dataset's content: the same settings and inputs give the same ``dataset.npz``
    (:func:`~dpflow_core.conversion.inputs.dataset_key` hashes them).

    Attributes:
        image_size: (W, H) pixels of the frames (each side 8-8192); also ``"W,H"`` or ``"WxH"`` text. None keeps
            the camera's native size: :func:`~dpflow_core.conversion.align.align_episode` and the LeRobot export
            take that, a ``dataset.npz`` needs a size.
        invalid_pose_policy: ``"trim"`` keeps the longest stretch of frames with valid poses, ``"reject"``
            rejects an episode with any invalid pose (:data:`INVALID_POSE_POLICIES`).
        min_overlap_fraction: an episode whose kept frames span less than this fraction of its recording
            (0-1) is rejected (``low_coverage``).
        frequency_tolerance: relative tolerance (0 < x < 1) within which an episode's rate agrees with its task's.
        rate_policy: an episode at another rate than its task's is resampled onto the task's grid
            (``"resample"``), kept as a dataset of its own (``"group"``) or rejected (``"reject"``;
            :data:`RATE_POLICIES`).
        max_gap_s: camera holes longer than this (seconds, > 0) are never bridged by interpolation.
        gap_policy: such a hole splits the episode into pieces (``"split"``) or rejects it (``"reject"``;
            :data:`GAP_POLICIES`).
        min_segment_frames: the minimum episode length (frames, >= 2) of a whole episode and of a piece.
        min_pose_score: a pose whose VIO ``score`` is below this counts as invalid too (0: only ``pose_valid``).
        short_episode_policy: an episode or piece under ``min_segment_frames`` frames is rejected (``"reject"``)
            or kept with a warning (``"warn"``; :data:`SHORT_EPISODE_POLICIES`).
        plausibility: thresholds and policies of the pose, gripper and IMU rules
            (:class:`~dpflow_core.recordings.plausibility.PlausibilityOptions`; also a dict of its fields or its
            JSON text; None: the defaults, docs/formats.md).

    Values are kept as given (an int stays an int), so that the dataset key of given options does not change.

    Raises:
        ConversionError: ``bad_option`` naming the setting, when a value is out of its range or not one of
            its choices.
    """

    image_size: tuple[int, int] | None = setting(
        DEFAULT_IMAGE_SIZE, "--image-size", ("image_width", "image_height"), "Frame size W,H in pixels.")
    invalid_pose_policy: str = setting(
        "trim", "--invalid-pose-policy", "invalid_pose_policy",
        "Frames with pose_valid == false: 'trim' (keep the longest valid stretch) or 'reject' the episode.")
    min_overlap_fraction: float = setting(
        0.5, "--min-overlap", "min_overlap_fraction",
        "Reject an episode whose aligned frames cover less than this fraction of the recording.")
    frequency_tolerance: float = setting(
        0.05, "--frequency-tolerance", "frequency_tolerance", "Relative tolerance of an episode's frame rate.")
    rate_policy: str = setting(
        "resample", "--rate-policy", "rate_policy",
        "An episode at another rate than its task's: 'resample' it to the task's rate (images held, poses "
        "interpolated), 'group' (a dataset of its own beside the output, <stem>-<rate>hz.npz) or 'reject'.")
    max_gap_s: float = setting(
        DEFAULT_MAX_GAP_S, "--max-gap", "max_gap_s", "Seconds: longer holes in the camera stream are never bridged.")
    gap_policy: str = setting(
        "split", "--gap-policy", "gap_policy",
        "A camera hole longer than the maximum gap: 'split' the episode there or 'reject' it.")
    min_segment_frames: int = setting(
        DEFAULT_MIN_SEGMENT_FRAMES, "--min-segment-frames", "min_segment_frames",
        "Minimum episode length in frames, of a whole episode and of a piece after a split.")
    min_pose_score: float = setting(
        0.0, "--min-pose-score", "min_pose_score", "Poses with a lower VIO score count as invalid (0: none).")
    short_episode_policy: str = setting(
        "reject", "--short-episode-policy", "short_episode_policy",
        "An episode or piece shorter than the minimum episode length: 'reject' it, or keep it and 'warn'.")
    plausibility: "PlausibilityOptions | None" = setting(
        None, "--plausibility", "plausibility",
        "Thresholds and policies of the plausibility rules (docs/formats.md): a mapping of their fields, e.g. "
        "{\"max_speed_mps\": 4, \"policies\": {\"gripper_dead\": \"warn\"}} (JSON on the command line); "
        "empty: the defaults.")

    def __post_init__(self):
        def set_(name: str, value: Any) -> None:  # frozen: each value is normalised once, here
            object.__setattr__(self, name, value)

        if isinstance(self.image_size, str):
            set_("image_size", image_size_of(self.image_size))
        if self.image_size is not None:
            set_("image_size", check_image_size(self.image_size))
        _one_of("invalid_pose_policy", self.invalid_pose_policy, INVALID_POSE_POLICIES)
        _one_of("gap_policy", self.gap_policy, GAP_POLICIES)
        if not self.max_gap_s > 0:
            raise ConversionError(f"max_gap_s must be > 0 seconds, got {self.max_gap_s!r}", code="bad_option")
        if not 0 < self.frequency_tolerance < 1:
            raise ConversionError(f"frequency_tolerance must be in (0, 1), got {self.frequency_tolerance}",
                                  code="bad_option")
        _one_of("rate_policy", self.rate_policy, RATE_POLICIES)
        if not (isinstance(self.min_segment_frames, numbers.Integral) and self.min_segment_frames >= 2):
            raise ConversionError(f"min_segment_frames must be a whole number of frames >= 2, got "
                                  f"{self.min_segment_frames!r}", code="bad_option")
        _one_of("short_episode_policy", self.short_episode_policy, SHORT_EPISODE_POLICIES)
        set_("plausibility", plausibility_of(self.plausibility))

    def content_checks(self) -> dict:
        """The plausibility options with every policy filled in and the short-episode policy, JSON-able:
        ``{"plausibility": PlausibilityOptions.to_dict(), "short_episode_policy": ...}`` (an alignment job's
        ``content_checks``)."""
        return {"plausibility": self.plausibility.to_dict(), "short_episode_policy": self.short_episode_policy}

    def options(self, topics: Any) -> dict:
        """The settings as one JSON-able dict with the manifest's ``topics`` (a
        :class:`~dpflow_core.recordings.topics.TopicMap`): what ``dataset.json`` records as ``options`` and
        :func:`~dpflow_core.conversion.inputs.options_key` hashes. ``min_pose_score`` appears only when set,
        as datasets converted before it existed were keyed without it."""
        out = {
            "content_checks": self.content_checks(),
            "image_size": None if self.image_size is None else list(self.image_size),
            "invalid_pose_policy": self.invalid_pose_policy,
            "min_overlap_fraction": self.min_overlap_fraction,
            "frequency_tolerance": self.frequency_tolerance,
            "topics": {"camera": topics.camera, "pose": topics.pose, "gripper": topics.gripper},
            "max_gap_s": self.max_gap_s,
            "gap_policy": self.gap_policy,
            "min_segment_frames": self.min_segment_frames,
            "rate_policy": self.rate_policy,
        }
        if self.min_pose_score:
            out["min_pose_score"] = self.min_pose_score
        return out

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> "ConversionSettings":
        """The settings from a command's parameters, named as the ``option`` flags (``--max-gap`` -> ``max_gap``);
        a parameter left out, or None, takes the default.

        Raises:
            ConversionError: ``bad_option`` (see the class).
        """
        return cls(**fields_from_options(cls, values))

    @classmethod
    def from_config(cls, config: Any) -> "ConversionSettings":
        """The settings from the ``dataset_npz`` asset's Dagster config (its ``config`` fields; several fields
        of one setting give a tuple).

        Raises:
            ConversionError: ``bad_option`` (see the class).
        """
        out = {}
        for name, meta in front_ends(cls).items():
            where = meta["config"]
            out[name] = tuple(getattr(config, c) for c in where) if isinstance(where, tuple) else getattr(config, where)
        return cls(**out)
