"""The whole-graph job ``dpflow_pipeline`` and the ``conversion_automation`` sensor."""

from __future__ import annotations

import dagster as dg

from dpflow_dagster.sensors import conversion_automation

defs = dg.Definitions(
    sensors=[conversion_automation],
    # The whole graph but the UMI export (asked for by hand); the README's main job (dpflow demo) runs it.
    jobs=[dg.define_asset_job(
        "dpflow_pipeline",
        selection=dg.AssetSelection.all() - dg.AssetSelection.assets("umi_dataset"),
        description="Recordings to an evaluated checkpoint, for one task partition (umi_dataset: materialize it by hand).",
    )],
)
