"""Protobuf schemas of the DAS messages, built at run time (no compiled protos).

Used by the sample-recording writer. Readers never need this module: every
MCAP file embeds its schemas as a FileDescriptorSet and is decoded from those.
Field layout follows formats.md section 1: each message carries the device
header ``arnold.common.proto.Header`` (``timestamp`` = capture time, uint64 ns).
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
_TYPES = {
    "string": _F.TYPE_STRING,
    "bytes": _F.TYPE_BYTES,
    "uint64": _F.TYPE_UINT64,
    "uint32": _F.TYPE_UINT32,
    "double": _F.TYPE_DOUBLE,
    "float": _F.TYPE_FLOAT,
    "bool": _F.TYPE_BOOL,
}


def _message(file: descriptor_pb2.FileDescriptorProto, name: str, fields: list[tuple]) -> None:
    msg = file.message_type.add(name=name)
    for number, (fname, ftype, *rest) in enumerate(fields, start=1):
        label = _F.LABEL_REPEATED if rest and rest[0] == "repeated" else _F.LABEL_OPTIONAL
        if ftype in _TYPES:
            msg.field.add(name=fname, number=number, type=_TYPES[ftype], label=label)
        else:
            msg.field.add(name=fname, number=number, type=_F.TYPE_MESSAGE, type_name=ftype, label=label)


def _files() -> list[descriptor_pb2.FileDescriptorProto]:
    header = descriptor_pb2.FileDescriptorProto(
        name="arnold/common/proto/header.proto", package="arnold.common.proto", syntax="proto3"
    )
    _message(
        header,
        "Header",
        [
            ("module_name", "string"),
            ("sequence_num", "uint64"),
            ("timestamp", "uint64"),
            ("topic_name", "string"),
            ("expect_hz", "float"),
            ("inputs", "string", "repeated"),
            ("version", "string"),
        ],
    )
    geometry = descriptor_pb2.FileDescriptorProto(
        name="foxglove/geometry.proto", package="foxglove", syntax="proto3"
    )
    _message(geometry, "Vector3", [("x", "double"), ("y", "double"), ("z", "double")])
    _message(geometry, "Quaternion", [("x", "double"), ("y", "double"), ("z", "double"), ("w", "double")])
    _message(geometry, "Pose", [("position", ".foxglove.Vector3"), ("orientation", ".foxglove.Quaternion")])

    def sensor(name: str, fields: list[tuple]) -> descriptor_pb2.FileDescriptorProto:
        f = descriptor_pb2.FileDescriptorProto(
            name=f"foxglove/{name}.proto",
            package="foxglove",
            syntax="proto3",
            dependency=["arnold/common/proto/header.proto", "foxglove/geometry.proto"],
        )
        _message(f, name, [("header", ".arnold.common.proto.Header"), *fields])
        return f

    return [
        header,
        geometry,
        sensor("CompressedImage", [("frame_id", "string"), ("data", "bytes"), ("format", "string")]),
        sensor(
            "CameraCalibration",
            [
                ("frame_id", "string"),
                ("width", "uint32"),
                ("height", "uint32"),
                ("distortion_model", "string"),
                ("D", "double", "repeated"),
                ("K", "double", "repeated"),
            ],
        ),
        sensor(
            "PoseInFrame",
            [("frame_id", "string"), ("pose", ".foxglove.Pose"), ("pose_valid", "bool"), ("score", "float")],
        ),
        sensor("MagneticEncoderMeasurement", [("value", "double")]),
        sensor("Imu", [("angular_velocity", ".foxglove.Vector3"), ("linear_acceleration", ".foxglove.Vector3")]),
    ]


@lru_cache(maxsize=1)
def das_messages() -> SimpleNamespace:
    """Message classes ``CompressedImage``, ``CameraCalibration``, ``PoseInFrame``,
    ``MagneticEncoderMeasurement``, ``Imu`` (package ``foxglove``) and ``Header``
    (``arnold.common.proto``), built in a private descriptor pool."""
    pool = descriptor_pool.DescriptorPool()
    for f in _files():
        pool.Add(f)
    names = ["CompressedImage", "CameraCalibration", "PoseInFrame", "MagneticEncoderMeasurement", "Imu"]
    classes = {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"foxglove.{n}")) for n in names}
    classes["Header"] = message_factory.GetMessageClass(pool.FindMessageTypeByName("arnold.common.proto.Header"))
    return SimpleNamespace(**classes)
