"""The replay buffer in ``dataset.npz``: its reader and its writer, side by side.

:mod:`~dpflow_core.replay_buffer.reader` maps the members of an existing file (:class:`ReplayBuffer`);
:mod:`~dpflow_core.replay_buffer.writer` streams members into a new one (:func:`write_npz`). The
layout is formats.md section 2.
"""

from __future__ import annotations

from dpflow_core.replay_buffer.reader import (
    DATA_PREFIX, DATA_SPEC, EPISODE_ENDS_MEMBER, INFO_MEMBER, META_PREFIX, REQUIRED_INFO_FIELDS, MemberLayout,
    ReplayBuffer,
)
from dpflow_core.replay_buffer.writer import ZIP_DATE_TIME, NpzMember, npy_data_offset, npy_header, write_npz

__all__ = [
    "DATA_PREFIX", "DATA_SPEC", "EPISODE_ENDS_MEMBER", "INFO_MEMBER", "META_PREFIX", "REQUIRED_INFO_FIELDS",
    "ZIP_DATE_TIME", "MemberLayout", "NpzMember", "ReplayBuffer", "npy_data_offset", "npy_header", "write_npz",
]
