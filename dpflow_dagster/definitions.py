"""Root Dagster definitions: merges each stage module's ``defs`` with the resources.

Every asset is partitioned by task (:mod:`dpflow_dagster.partitions`); the
``dpflow_pipeline`` job runs the whole graph for one task partition.
"""

from __future__ import annotations

import dagster as dg

from dpflow_dagster import assets_dataset, assets_lerobot, assets_recordings, assets_remote, assets_training, resources
from dpflow_dagster.sensors import conversion_automation

defs = dg.Definitions.merge(
    assets_recordings.defs,
    assets_dataset.defs,
    assets_lerobot.defs,
    assets_remote.defs,
    assets_training.defs,
    dg.Definitions(
        resources=resources.default_resources(),
        sensors=[conversion_automation],
        # The whole graph but the UMI export (asked for by hand); the README's main job (dpflow demo) runs it.
        jobs=[dg.define_asset_job(
            "dpflow_pipeline",
            selection=dg.AssetSelection.all() - dg.AssetSelection.assets("umi_dataset"),
            description="Recordings to an evaluated checkpoint, for one task partition (umi_dataset: materialize it by hand).",
        )],
    ),
)
