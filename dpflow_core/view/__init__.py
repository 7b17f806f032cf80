"""Viewing in Rerun: episodes, datasets, predictions and rollouts written as ``.rrd`` recordings.

Each view is one function that writes one ``.rrd`` (rerun-sdk) and returns what it wrote:
:func:`~dpflow_core.view.episode.view_episode` (a raw ``<STEM>_vio.mcap``, streamed;
:func:`~dpflow_core.view.episode.view_episodes` each of a task folder's, every output checked first),
:func:`~dpflow_core.view.dataset.view_dataset` (what training sees: aligned rows, the observation
windows and the action chunks), :func:`~dpflow_core.view.dataset.view_predictions` (a checkpoint's
action chunks against the recorded ones) and :func:`~dpflow_core.view.rollouts.view_rollouts`
(closed-loop rollouts of the simulated world). :func:`~dpflow_core.view.serve.serve_rrd` serves a
recording with Rerun's web viewer on loopback. ``dpflow view`` (:mod:`dpflow_core.cli.view`) calls them.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {
    "ViewError": "rrd",
    "view_episode": "episode",
    "view_episodes": "episode",
    "episode_output": "episode",
    "episode_sources": "episode",
    "dataset_view_name": "dataset",
    "view_dataset": "dataset",
    "view_predictions": "dataset",
    "view_rollouts": "rollouts",
    "serve_rrd": "serve",
    "view_command": "rrd",
})

__all__ = ["ViewError", "dataset_view_name", "episode_output", "episode_sources", "serve_rrd", "view_command",
           "view_dataset", "view_episode", "view_episodes", "view_predictions", "view_rollouts"]
