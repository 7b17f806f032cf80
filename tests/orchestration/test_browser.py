"""The Dagster UI in a real browser: materialize the dataset assets on sample recordings.

``dagster dev`` runs on a loopback port with a temporary ``DAGSTER_HOME``;
headless Debian Chromium (driven by Playwright) opens the asset graph, filters
it to the dataset assets, presses "Materialize", adds the task partition in the
launch dialog, launches one run and follows it until it succeeds; the asset page
then shows the episode quality table with its preview thumbnails. Screenshots
are saved in the test's temporary folder.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from browser import REPO, chromium_page, start_dagster_dev, stop_dagster_dev  # noqa: F401  (fixture)
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


def _skip_newsletter(page) -> None:
    """Dismiss the first-visit newsletter dialog whenever it shows, without waiting for it.

    Playwright's locator handler runs before any later action the dialog would block (and not at
    all when it never shows), so no test pays a fixed wait for a dialog that may not come.
    """
    skip = page.get_by_role("button", name="Skip")
    page.add_locator_handler(skip, lambda locator: locator.click())


@pytest.mark.browser
@pytest.mark.slow
def test_materialize_dataset_assets_from_the_ui(dagster_dev, chromium_page, tmp_path):
    dev, page = dagster_dev, chromium_page
    present = _asset_names(dev)
    selected = [name for name in DATASET_ASSETS if name in present]
    assert "paired_episodes" in selected, sorted(present)

    page.goto(f"{dev.url}/asset-groups")
    _skip_newsletter(page)
    try:  # a fresh instance shows the dialog on its first page: close it before typing into the page
        page.get_by_role("button", name="Skip").wait_for(state="visible", timeout=10_000)
        page.get_by_role("button", name="Skip").click()
    except PlaywrightTimeoutError:
        pass  # not shown (or already closed by the handler); the retry below covers a late one
    query = " or ".join(f"key:{name}" for name in selected)
    for attempt in range(3):
        # the handler dismisses the dialog before a click, but keys typed while it opens go to it:
        # then the selection is typed again once it has gone
        page.locator("div.CodeMirror").first.click()
        page.keyboard.press("Control+A")
        page.keyboard.type(query)
        page.keyboard.press("Enter")
        try:
            page.get_by_text(selected[0], exact=True).first.wait_for(state="visible", timeout=20_000)
            break
        except PlaywrightTimeoutError:
            if attempt == 2:
                raise
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


#: Two task folders of the demo-like run whose check results the Checks tab must show side by side.
TWO_TASKS = ("pick_cup", "wipe_table")


@pytest.fixture
def two_tasks_home(tmp_path, monkeypatch):
    """A DAGSTER_HOME where the dataset part of the graph (with its checks) ran for two tasks, as
    ``dpflow demo`` runs it: the definitions' own assets, checks and IO manager on that instance."""
    import dagster as dg

    from dpflow_dagster.definitions import defs

    recordings, work, home = tmp_path / "recordings", tmp_path / "work", tmp_path / "dagster_home"
    for k, task in enumerate(TWO_TASKS):
        write_task(recordings, episodes=2, seconds=2, seed=k, task=task, spec=SampleSpec(width=160, height=120))
    home.mkdir()
    shutil.copy(REPO / "dagster_home" / "dagster.yaml", home / "dagster.yaml")
    monkeypatch.setenv("DPFLOW_RECORDINGS_ROOT", str(recordings))
    monkeypatch.setenv("DPFLOW_WORKDIR", str(work))
    job = defs.resolve_job_def("dpflow_pipeline").get_subset(
        asset_selection={dg.AssetKey("paired_episodes"), dg.AssetKey("dataset_npz")})
    run_config = {"ops": {"paired_episodes": {"config": {"quality": False}},
                          "dataset_npz": {"config": {"image_width": 32, "image_height": 24, "workers": 1}}}}
    steps = {}
    with dg.DagsterInstance.from_config(str(home)) as instance:
        instance.add_dynamic_partitions("task", list(TWO_TASKS))
        for task in TWO_TASKS:
            result = job.execute_in_process(run_config=run_config, instance=instance, partition_key=task)
            assert result.success
            steps[task] = result.output_for_node("dataset_npz").total_steps
    env = {"DPFLOW_RECORDINGS_ROOT": str(recordings), "DPFLOW_WORKDIR": str(work), "WANDB_MODE": "offline"}
    return env, steps


@pytest.mark.browser
@pytest.mark.slow
def test_the_checks_tab_shows_each_tasks_check_results(two_tasks_home, chromium_page, tmp_path):
    """After two tasks ran, a check's execution history lists one result per task (its partition, Passed,
    the description with that task's own T) and its Partitions tab counts both as passed."""
    env, steps = two_tasks_home
    assert len(set(steps.values())) == 2, steps  # the two tasks' results are told apart by their T
    dev = start_dagster_dev(tmp_path, env)
    try:
        page = chromium_page
        page.goto(f"{dev.url}/assets/dataset_npz?view=checks")
        _skip_newsletter(page)
        page.get_by_text("episode_ends_valid").first.click()
        page.get_by_role("tab", name="Execution history").click()
        for task, total in steps.items():
            row = page.locator("tr", has_text=task)
            row.first.wait_for(state="visible")
            assert row.count() == 1, task
            text = row.first.inner_text()
            assert "Passed" in text and f"last = {total}, T = {total}" in text, (task, text)
        page.screenshot(path=str(tmp_path / "check_history.png"))
        page.locator("button[role=tab]", has_text="Partitions").click()
        page.get_by_text("Passed (2)").first.wait_for(state="visible")
        for task in TWO_TASKS:
            assert page.get_by_text(task, exact=True).count() >= 1, task
        page.screenshot(path=str(tmp_path / "check_partitions.png"))
    finally:
        status = stop_dagster_dev(dev)
    assert status == 0, f"dagster dev did not stop cleanly on TERM ({status}):\n{dev.log_tail()}"
    for name in ("check_history.png", "check_partitions.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
