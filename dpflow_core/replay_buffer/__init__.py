"""The replay buffer in ``dataset.npz``: its reader and its writer, side by side.

:mod:`~dpflow_core.replay_buffer.reader` maps the members of an existing file (:class:`ReplayBuffer`);
:mod:`~dpflow_core.replay_buffer.writer` writes a new one, frames first and appended while later
episodes are still being made (:class:`NpzStreamWriter`), or all at once (:func:`write_npz`). The
layout is formats.md section 2.
"""

from __future__ import annotations

from dpflow_core.replay_buffer.reader import (
    DATA_PREFIX, DATA_SPEC, EPISODE_ENDS_MEMBER, INFO_MEMBER, META_PREFIX, REQUIRED_INFO_FIELDS, MemberLayout,
    ReplayBuffer,
)
from dpflow_core.replay_buffer.writer import (
    FRAMES_MEMBER, ZIP_DATE_TIME, NpzMember, NpzStreamWriter, npy_data_offset, npy_header, write_npz,
)

__all__ = [
    "DATA_PREFIX", "DATA_SPEC", "EPISODE_ENDS_MEMBER", "INFO_MEMBER", "META_PREFIX", "REQUIRED_INFO_FIELDS",
    "FRAMES_MEMBER", "ZIP_DATE_TIME", "MemberLayout", "NpzMember", "NpzStreamWriter", "ReplayBuffer", "npy_data_offset",
    "npy_header", "write_npz",
]
