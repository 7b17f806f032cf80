"""Topic map of a Matrix Studio recording: which topic carries what.

Names vary by device and Matrix Studio version, so they are configuration. The
defaults are those of the GenRobot DAS single-arm gripper (formats.md section 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopicMap:
    """Topics and accepted schema names of one recording layout.

    Attributes:
        camera: H.264 camera topic (one Annex-B access unit per message, 30 Hz nominal).
        camera_schemas: schema names accepted for ``camera``.
        pose: VIO pose topic in ``<STEM>_vio.mcap`` (camera0 optical centre pose,
            position in metres, orientation quaternion; ``pose_valid`` and ``score``).
        pose_schemas: schema names accepted for ``pose``.
        gripper: gripper-width topic (``value`` in metres, 50 Hz nominal).
        gripper_schemas: schema names accepted for ``gripper``.
        imu: IMU topic (200 Hz nominal); optional for conversion.
        camera_info: calibration topic; optional.
    """

    camera: str = "/robot0/sensor/camera0/compressed"
    camera_schemas: tuple[str, ...] = ("foxglove.CompressedImage", "foxglove.CompressedVideo")
    pose: str = "/robot0/vio/eef_pose"
    pose_schemas: tuple[str, ...] = ("foxglove.PoseInFrame",)
    gripper: str = "/robot0/sensor/magnetic_encoder"
    gripper_schemas: tuple[str, ...] = ("foxglove.MagneticEncoderMeasurement",)
    imu: str = "/robot0/sensor/imu"
    imu_schemas: tuple[str, ...] = ("foxglove.Imu",)
    camera_info: str = "/robot0/sensor/camera0/camera_info"
    extra_cameras: tuple[str, ...] = field(default_factory=tuple)

    def required(self) -> dict[str, tuple[str, ...]]:
        """Topics a ``<STEM>_vio.mcap`` must contain for conversion, with accepted schemas."""
        return {
            self.camera: self.camera_schemas,
            self.pose: self.pose_schemas,
            self.gripper: self.gripper_schemas,
        }


DAS_DEFAULT = TopicMap()
