"""The wire format of openpi's websocket policy protocol, as ``openpi-client`` speaks it.

Learned from openpi's ``openpi_client`` package (``msgpack_numpy``,
``websocket_client_policy``) and its ``serving/websocket_policy_server.py``:

- one websocket connection per client, binary frames, no compression;
- right after the handshake the server sends one frame: the metadata (a map);
- then each client frame is an observation map and the server answers each with
  one frame, the action map; an answer that is a *text* frame is an error
  message (``WebsocketClientPolicy.infer`` raises ``RuntimeError`` with it);
- frames are msgpack. A numpy array travels as a map ``{b"__ndarray__": True,
  b"data": raw bytes (C order), b"dtype": dtype.str, b"shape": [...]}``, a numpy
  scalar as ``{b"__npgeneric__": True, b"data": item, b"dtype": dtype.str}``
  (byte keys, as ``msgpack_numpy`` writes them; the server also reads text keys);
  object, void and complex dtypes are refused (they would need pickle).

Unlike openpi's server, an error does not close the connection: the client may
send its next observation on the same socket.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from dpflow_core.serving.timing import ObservationError

_REFUSED_KINDS = ("V", "O", "c")


def _encode(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in _REFUSED_KINDS:
        raise TypeError(f"dtype {obj.dtype} cannot travel over the policy protocol")
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return {b"__ndarray__": True, b"data": a.tobytes(), b"dtype": a.dtype.str, b"shape": list(a.shape)}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"{type(obj).__name__} cannot travel over the policy protocol")


def _field(obj: dict, name: str) -> Any:
    """``obj[name]`` under a byte key (``msgpack_numpy``'s) or a text key (a client written from the docs)."""
    key = name.encode()
    if key in obj:
        return obj[key]
    if name in obj:
        return obj[name]
    raise ObservationError(f"an encoded array lacks its {name!r} field (has {sorted(map(str, obj))})")


def _decode(obj: dict) -> Any:
    if b"__ndarray__" in obj or "__ndarray__" in obj:
        try:
            dtype = np.dtype(_field(obj, "dtype"))
            shape = tuple(int(n) for n in _field(obj, "shape"))
        except (TypeError, ValueError) as exc:
            raise ObservationError(f"an encoded array has a bad dtype or shape: {exc}") from exc
        if dtype.kind in _REFUSED_KINDS:
            raise ObservationError(f"array dtype {dtype} is not accepted")
        data = _field(obj, "data")
        if not isinstance(data, (bytes, bytearray)):
            raise ObservationError(f"an encoded array's data must be raw bytes (C order), got {type(data).__name__}")
        if len(data) != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ObservationError(f"array of shape {shape} {dtype} carries {len(data)} bytes")
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()  # writable: torch.from_numpy warns on read-only
    if b"__npgeneric__" in obj or "__npgeneric__" in obj:
        return np.dtype(_field(obj, "dtype")).type(_field(obj, "data"))
    return obj


def pack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (maps, lists, numbers, strings, numpy arrays and scalars)."""
    return msgpack.packb(obj, default=_encode, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """The value of a msgpack frame (arrays as writable numpy arrays).

    Raises:
        ObservationError: not msgpack, or an array whose bytes do not fit its shape and dtype.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ObservationError("frames must be binary msgpack, got a text frame")
    try:
        return msgpack.unpackb(data, object_hook=_decode, raw=False, strict_map_key=False)
    except ObservationError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ObservationError(f"frame is not valid msgpack ({type(exc).__name__}: {exc})") from exc
