"""Following a growing JSON-lines file on the GPU server from a byte offset (the Pipes messages file).

Takes a server and a path; gives the JSON objects of the complete lines added since the last
poll. The offset moves only past lines returned, so a poll interrupted by a dropped SSH
connection (the error propagates) reads the same bytes again on the next poll, over a new
connection: no line is lost and none is returned twice. The writer (``dagster-pipes``' file
channel) appends one ``json.dumps`` line per message; a trailing partial line is left for later.
"""

from __future__ import annotations

import json
from typing import Any

from dpflow_core.errors import RemoteError
from dpflow_core.server import GpuServer


class JsonLinesFollower:
    """Incremental reader of a JSON-lines file on ``server`` (local or over SSH).

    Attributes:
        path: the file on the server (it may not exist yet: polls return nothing until it does).
        offset: bytes consumed so far (the end of the last complete line returned).
        bad_lines: complete lines that were not JSON objects (skipped, counted).
    """

    def __init__(self, server: GpuServer, path: str, offset: int = 0):
        self.server = server
        self.path = path
        self.offset = int(offset)
        self.bad_lines = 0

    def poll(self, max_bytes: int = 4 << 20) -> list[dict[str, Any]]:
        """The objects of the complete lines after :attr:`offset` (up to ``max_bytes``), in file order.

        Raises:
            RemoteError: other than ``not_found`` (the file not written yet), and the transport's own
                connection errors; :attr:`offset` is then unchanged.
        """
        try:
            lines, new_offset = self.server.read_lines(self.path, self.offset, max_bytes)
        except RemoteError as exc:
            if exc.code == "not_found":
                return []
            raise
        out = []
        for line in lines:
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                out.append(obj)
            else:
                self.bad_lines += 1
        self.offset = new_offset
        return out


__all__ = ["JsonLinesFollower"]
