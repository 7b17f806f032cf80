"""The Dagster UI in a real browser: materialize the dataset assets on sample recordings.

``dagster dev`` runs on a loopback port with a temporary ``DAGSTER_HOME``;
headless Debian Chromium (driven by Playwright) opens the asset graph, filters
it to the dataset assets, presses "Materialize", adds the task partition in the
launch dialog, launches one run and follows it until it succeeds; the asset page
then shows the episode quality table with its preview thumbnails. Screenshots
are saved in the test's temporary folder.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from browser import chromium_page, start_dagster_dev, stop_dagster_dev  # noqa: F401  (fixture)
from dpflow_core.recordings.samples import SampleSpec, write_task

#: The dataset assets, upstream first; those the definitions hold are materialized.
DATASET_ASSETS = ("paired_episodes", "dataset_npz")
#: The task folder written by ``write_task``: the partition added in the launch dialog.
TASK = "pick_place"
TERMINAL = {"SUCCESS", "FAILURE", "CANCELED"}


@pytest.fixture
def dagster_dev(tmp_path):
    """``dagster dev`` over two 2-s sample episodes; stopped by PID after the test."""
    recordings = tmp_path / "recordings"
    write_task(recordings, episodes=2, seconds=2, spec=SampleSpec(width=160, height=120))
    env = {
        "DPFLOW_RECORDINGS_ROOT": str(recordings),  # the output root; the task folder is the partition
        "DPFLOW_WORKDIR": str(tmp_path / "work"),
        "WANDB_MODE": "offline",
    }
    dev = start_dagster_dev(tmp_path, env)
    try:
        yield dev
    finally:
        status = stop_dagster_dev(dev)
    assert status == 0, f"dagster dev did not stop cleanly on TERM ({status}):\n{dev.log_tail()}"


def _asset_names(dev) -> set[str]:
    data = dev.graphql("{ assetNodes { assetKey { path } } }")
    return {"/".join(n["assetKey"]["path"]) for n in data["assetNodes"]}


def _latest_metadata(dev, name: str) -> tuple[str, dict[str, object]]:
    """(run id, label -> value) of the asset's latest materialization; the partition under "partition"."""
    query = """
    query($key: AssetKeyInput!) { assetOrError(assetKey: $key) { ... on Asset {
      assetMaterializations(limit: 1) { runId partition metadataEntries { label
        ... on IntMetadataEntry { intValue } ... on TextMetadataEntry { text }
        ... on PathMetadataEntry { path } ... on FloatMetadataEntry { floatValue }
        ... on MarkdownMetadataEntry { mdStr } } } } } }
    """
    data = dev.graphql(query, {"key": {"path": [name]}})
    (mat,) = data["assetOrError"]["assetMaterializations"]
    values: dict[str, object] = {"partition": mat["partition"]}
    for e in mat["metadataEntries"]:
        values[e["label"]] = next((e[k] for k in ("intValue", "text", "path", "floatValue", "mdStr") if k in e), None)
    return mat["runId"], values


@pytest.mark.browser
@pytest.mark.slow
def test_materialize_dataset_assets_from_the_ui(dagster_dev, chromium_page, tmp_path):
    dev, page = dagster_dev, chromium_page
    present = _asset_names(dev)
    selected = [name for name in DATASET_ASSETS if name in present]
    assert "paired_episodes" in selected, sorted(present)

    page.goto(f"{dev.url}/asset-groups")
    skip = page.get_by_role("button", name="Skip")  # first-visit newsletter dialog
    try:
        skip.wait_for(state="visible", timeout=15_000)
        skip.click()
    except Exception:  # noqa: BLE001 - the dialog is optional; the next steps fail loudly if it blocks
        pass
    page.locator("div.CodeMirror").first.click()
    page.keyboard.type(" or ".join(f"key:{name}" for name in selected))
    page.keyboard.press("Enter")
    for name in selected:
        page.get_by_text(name, exact=True).first.wait_for(state="visible")
    page.screenshot(path=str(tmp_path / "asset_graph.png"))

    runs_before = {r["runId"] for r in dev.runs()}
    page.locator("button", has_text="Materialize").first.click()
    # the assets are partitioned by task: add the task folder's partition in the launch dialog
    page.get_by_text("Add a partition").click()
    page.get_by_placeholder("name", exact=True).fill(TASK)  # the "Partition name" field
    page.get_by_role("button", name="Save").click()
    page.get_by_text("1 partition", exact=True).wait_for(state="visible")
    page.screenshot(path=str(tmp_path / "launch_dialog.png"))
    page.get_by_role("button", name="Launch 1 run").click()

    deadline = time.monotonic() + 420
    run = None
    while time.monotonic() < deadline:
        new = [r for r in dev.runs() if r["runId"] not in runs_before]
        if new:
            run = new[0]
            if run["status"] in TERMINAL:
                break
        time.sleep(1)
    assert run is not None, f"no run was launched from the UI:\n{dev.log_tail()}"
    assert run["status"] == "SUCCESS", f"run {run['runId']} ended {run['status']}:\n{dev.log_tail()}"
    assert sorted("/".join(a["path"]) for a in run["assetSelection"]) == sorted(selected)
    assert run["tags"].get("dagster/partition") == TASK

    page.goto(f"{dev.url}/runs/{run['runId']}")
    page.get_by_text("Success", exact=True).first.wait_for(state="visible")
    page.get_by_text("RUN_SUCCESS").first.wait_for(state="visible")
    page.screenshot(path=str(tmp_path / "run.png"))

    page.goto(f"{dev.url}/assets/paired_episodes?view=events&partition={TASK}")
    page.get_by_text("accepted", exact=True).first.wait_for(state="visible")
    page.screenshot(path=str(tmp_path / "paired_episodes.png"))
    # episode quality at a glance: the table's preview thumbnails decode in the browser
    page.locator("tr", has_text="quality").get_by_text("[Show Markdown]").click()
    thumbnails = page.locator('img[src^="data:image/jpeg;base64,"]')
    thumbnails.nth(1).wait_for(state="visible")
    assert thumbnails.count() == 2
    assert [thumbnails.nth(i).evaluate("img => img.naturalWidth") for i in range(2)] == [360, 360]
    page.screenshot(path=str(tmp_path / "episode_quality.png"))

    run_id, paired = _latest_metadata(dev, "paired_episodes")
    assert run_id == run["runId"] and paired["partition"] == TASK
    assert paired["accepted"] == 2 and paired["rejected"] == 0
    assert Path(str(paired["manifest_path"])).is_file()
    quality = str(paired["quality"]).splitlines()
    assert len(quality) == 4 and all("](data:image/jpeg;base64," in row for row in quality[2:])
    if "dataset_npz" in selected:
        run_id, dataset = _latest_metadata(dev, "dataset_npz")
        assert run_id == run["runId"] and dataset["partition"] == TASK
        assert dataset["n_episodes"] == 2
        assert Path(str(dataset["path"])).is_file()

    for name in ("asset_graph.png", "launch_dialog.png", "run.png", "paired_episodes.png", "episode_quality.png"):
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
