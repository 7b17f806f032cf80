"""Root Dagster definitions: everything in the ``dpflow_dagster/defs`` folder, merged.

``dg`` (``dg dev``, ``dg check defs``, ``dg launch``) finds this module from the
``[tool.dg.project]`` table of pyproject.toml; ``workspace.yaml`` points
``dagster dev`` at it too. Each module of :mod:`dpflow_dagster.defs` holds one
stage's ``dg.Definitions``; :func:`dagster.load_from_defs_folder` merges them.
Every asset is partitioned by task (:mod:`dpflow_dagster.partitions`); the
``dpflow_pipeline`` job runs the whole graph for one task partition.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg

defs = dg.load_from_defs_folder(path_within_project=Path(__file__).parent)
