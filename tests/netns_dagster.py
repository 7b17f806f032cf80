"""Run inside a test host's network namespace (``ip netns exec``): the Dagster side of several servers.

    python tests/netns_dagster.py LAB.yaml RUN_NAME [DATASET.npz]

With ``DATASET``: materializes ``remote_dataset`` and its SHA-256 check with the ``gpu_server``
resource of the lab.yaml (:func:`dpflow_dagster.resources.gpu_server_from_lab_file`, as
``DPFLOW_LAB`` gives it). Then judges run ``RUN_NAME`` with
:func:`dpflow_core.runs.multihost.check_multihost_exit` (the ``natural_exit`` check of ``train_run``
on several hosts). Prints one JSON line: ``remote`` (the asset's value, its metadata and check
results, or null) and ``exit`` (passed, exit_codes, problems).
"""

from __future__ import annotations

import json
import sys

import dagster as dg

from synthetic_dataset import conversion_value  # tests/ is this script's folder, so on sys.path

from dpflow_core.runs.multihost import check_multihost_exit
from dpflow_dagster.defs.remote import remote_dataset, remote_dataset_sha256_match
from dpflow_dagster.partitions import task_partitions
from dpflow_dagster.resources import gpu_server_from_lab_file


def main(lab: str, run_name: str, dataset: str | None = None) -> dict:
    resource = gpu_server_from_lab_file(lab)
    out: dict = {"remote": None}
    if dataset:
        @dg.asset(name="dataset_npz", group_name="dataset")
        def dataset_npz_stub() -> dict:
            return conversion_value(dataset, 10.0)

        instance = dg.DagsterInstance.ephemeral()
        instance.add_dynamic_partitions(task_partitions.name, ["pick_place"])
        result = dg.materialize([dataset_npz_stub, remote_dataset, remote_dataset_sha256_match], partition_key="pick_place",
                                instance=instance, resources={"gpu_server": resource}, raise_on_error=False)
        [mat] = [m for m in result.get_asset_materialization_events() if m.asset_key == dg.AssetKey("remote_dataset")]
        out["remote"] = {
            "success": result.success, "value": result.output_for_node("remote_dataset").to_dict(),
            "metadata": {k: v.value for k, v in mat.materialization.metadata.items() if isinstance(v.value, (str, int, float, bool))},
            "checks": {e.check_name: e.passed for e in result.get_asset_check_evaluations()},
        }
    with resource.connect_all() as servers:
        report = check_multihost_exit(servers, run_name)
    out["exit"] = {"passed": report.passed, "exit_codes": list(report.exit_codes), "problems": list(report.problems)}
    return out


if __name__ == "__main__":
    print("NETNS_JSON " + json.dumps(main(*sys.argv[1:])))
