"""Serving a checkpoint to a robot: openpi's websocket protocol and the timing contract.

- :mod:`~dpflow_core.serving.timing`: timestamped streams -> the observation training
  cut (:func:`~dpflow_core.serving.timing.align_observation`), and which actions of a
  timed chunk are still ahead (:func:`~dpflow_core.serving.timing.actions_to_execute`);
- :mod:`~dpflow_core.serving.protocol`: msgpack frames with numpy arrays, as ``openpi-client``;
- :mod:`~dpflow_core.serving.settings`: :class:`~dpflow_core.serving.settings.ServeSettings`;
- :mod:`~dpflow_core.serving.server`: ``dpflow serve`` (metadata on connect, concurrent
  requests batched on one inference thread, errors answered on the socket);
- :mod:`~dpflow_core.serving.client`: :class:`~dpflow_core.serving.client.RemotePolicy`,
  a served policy with the surface of :class:`dpflow_core.inference.Policy`.

docs/serving.md describes the protocol and draws the timeline. Names are imported
from their submodule on first use (the settings need neither torch nor websockets).
"""

from dpflow_core._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "MAX_AGE_S": "timing",
    "ObservationError": "timing",
    "StaleObservationError": "timing",
    "Stream": "timing",
    "actions_to_execute": "timing",
    "align_observation": "timing",
    "ServeSettings": "settings",
    "RemotePolicy": "client",
    "ServingError": "client",
    "serve": "server",
    "serve_command": "settings",
})
