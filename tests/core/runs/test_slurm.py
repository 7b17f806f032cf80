"""Runs on a real Slurm cluster (slurm-wlm 22.05 + munge, two slurmd CPU nodes on 127.0.0.1), one per session.

Submitted through the local transport (the machine is its own login node). Ground truth comes from
Slurm itself (``sacct``, ``squeue``), the checkpoint files, and the trainer's log. The README's
Slurm lab.yaml is run end to end here (smoke, 2-node training, resume) through ``dpflow scale``;
all Slurm tests share this module so that they share one cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)
from scale_helpers import dpflow, readme_lab
from synthetic_dataset import conversion_value, write_synthetic_dataset

from dpflow_core.errors import RemoteError
from dpflow_core.files import sha256_file
from dpflow_core.logs import parse_log_text
from dpflow_core.runs import RunSpec, TrainResult
from dpflow_core.runs.slurm import SLURM_RECORD, cancel_job, job_state, load_job, submit_run, wait_job
from dpflow_core.runs.slurm_checks import check_slurm_exit, check_slurm_released, slurm_preflight
from dpflow_core.server.lab import lab_servers
from dpflow_core.server import GpuServer, ServerConfig, SlurmSettings


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "dataset.npz"
    path = write_synthetic_dataset(path, n_episodes=4, episode_length=40, image_size=(32, 32), frequency_hz=10.0)
    return str(path), sha256_file(path)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    git = ["git", "-C", str(repo), "-c", "user.name=dpflow", "-c", "user.email=dpflow@localhost"]
    subprocess.run(git + ["init", "-q"], check=True)
    (repo / "README").write_text("training repository\n")
    subprocess.run(git + ["add", "README"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "initial"], check=True)
    return str(repo)


def _server(tmp_path, repo, **slurm) -> GpuServer:
    settings = SlurmSettings(partition="debug", **slurm)
    return GpuServer(ServerConfig.local(data_root=str(tmp_path / "cluster"), repo_path=repo, scheduler="slurm", slurm=settings))


def _train_spec(name, dataset, **kw) -> RunSpec:
    path, sha = dataset
    values = dict(name=name, kind="train", dataset_path=path, frequency_hz=10.0, dataset_sha256=sha, config_name="tiny",
                  epochs=1, max_train_steps=2, max_val_steps=1, batch_size=4, num_workers=0, logging_mode="disabled")
    values.update(kw)
    return RunSpec(**values)


def _sacct(cluster, job_id: str, fields: str) -> str:
    return cluster.run("sacct", "-c", "-n", "-P", "-j", job_id, "-o", fields).stdout.strip()


def _wait_running(server, job, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(server, job.job_id)
        if state is not None and state.state == "RUNNING":
            return state
        time.sleep(0.2)
    raise AssertionError(f"job {job.job_id} never ran: {job_state(server, job.job_id)}")


def test_settings_are_validated():
    with pytest.raises(RemoteError, match="time_limit"):
        SlurmSettings(time_limit="two hours")
    with pytest.raises(RemoteError, match="extra_sbatch"):
        SlurmSettings(extra_sbatch=("--qos=high; rm -rf /",))
    with pytest.raises(RemoteError, match="scheduler"):
        ServerConfig(scheduler="pbs")
    assert ServerConfig(scheduler="slurm").slurm == SlurmSettings()
    # a count that is not a whole number is named, as a lab.yaml would give it
    for key, value in (("nodes", "two"), ("gpus_per_node", 1.5), ("cpus_per_task", True)):
        with pytest.raises(RemoteError, match=f"slurm.{key} must be a whole number, got {value!r}"):
            SlurmSettings(**{key: value})
    assert SlurmSettings(nodes="2").nodes == 2  # YAML quoted digits
    # a typo at the server level lists the cluster and several-server keys too
    with pytest.raises(RemoteError, match=r"unknown key 'hots' under 'server'; valid keys: .*host, hosts, .*scheduler, slurm"):
        lab_servers({"hots": "x"}, "lab.yaml")


def test_scale_runs_take_the_train_command_template():
    from dpflow_core.runs import DEFAULT_TRAIN_COMMAND, RunSpec, SmokeSettings, TrainSettings
    from dpflow_core.runs.command import render_train_command
    from dpflow_core.runs.spec import UPSTREAM_TRAIN_COMMAND

    options = {"config_name": "train_diffusion_unet_timm_umi_workspace", "max_train_steps": 5, "batch_size": 4,
               "override": [], "train_command": "upstream"}
    smoke, train = SmokeSettings.from_options(options), TrainSettings.from_options(options)
    assert smoke.train_command == train.train_command == UPSTREAM_TRAIN_COMMAND
    assert TrainSettings.from_options({**options, "train_command": None}).train_command == DEFAULT_TRAIN_COMMAND
    spec = RunSpec(name="t1", kind="train", dataset_path="/shared/d/dataset.npz", frequency_hz=30.0,
                   config_name=train.config_name, train_command=train.train_command)
    line = render_train_command(spec.train_command, run_dir="/r", dataset=spec.dataset_path, overrides=["a=1"],
                                num_processes=8, gpu_ids=(0, 1, 2, 3), config_name=spec.config_name)
    assert line.startswith("train.py --config-name=train_diffusion_unet_timm_umi_workspace") and line.endswith("a=1")


def test_preflight_sees_the_partition_the_gpus_and_the_dataset_from_a_compute_node(slurm_cluster, tmp_path, repo, dataset):
    path, sha = dataset
    with _server(tmp_path, repo, nodes=2) as server:
        ok = slurm_preflight(server, path, sha)
        assert ok.passed, ok.checks
        assert {c[0] for c in ok.checks} == {"partition", "gpus", "dataset"}
        bad = slurm_preflight(server, path, "0" * 64)
        assert not bad.passed and f"SHA-256 {sha} != {'0' * 64}" in dict((c[0], c[2]) for c in bad.checks)["dataset"]
    with _server(tmp_path, repo, gpus_per_node=1) as server:
        gpus = dict((c[0], c) for c in slurm_preflight(server, path, sha).checks)["gpus"]
        assert gpus[1] is False and "at most 0 GPU(s) per node" in gpus[2]
    with GpuServer(ServerConfig.local(data_root=str(tmp_path), scheduler="slurm",
                                      slurm=SlurmSettings(partition="nosuch"))) as server:
        part = slurm_preflight(server, path, sha).checks[0]
        assert part[:2] == ("partition", False) and "nosuch" in part[2]
    with _server(tmp_path, repo, nodes=3) as server:
        part = slurm_preflight(server, path, sha).checks[0]
        assert part[1] is False and "2 usable node(s), 3 asked" in part[2]


def test_a_job_cancelled_from_outside_is_reported_as_cancelled(slurm_cluster, tmp_path, repo, dataset):
    with _server(tmp_path, repo, nodes=1) as server:
        job = submit_run(server, _train_spec("slurm-cancelled", dataset, epochs=1000, max_train_steps=1000))
        _wait_running(server, job)
        slurm_cluster.run("scancel", job.job_id)  # an administrator, from outside dpflow
        job = load_job(server, "slurm-cancelled")  # re-attached from the record: found by job id
        state = wait_job(server, job, timeout_s=60)
        assert state.state == "CANCELLED"
        report = check_slurm_exit(server, job)
        assert not report.passed
        assert any(p.startswith(f"job {job.job_id} CANCELLED: cancelled") for p in report.problems), report.problems
        release = check_slurm_released(server, job)
        assert release.passed, release.message


def test_a_foreign_job_of_the_same_name_is_never_cancelled(slurm_cluster, tmp_path, repo, dataset):
    name = "slurm-mine"
    foreign = slurm_cluster.run("sbatch", "--parsable", f"--job-name={name}", "-p", "debug", "-o", "/dev/null",
                                "--wrap", "sleep 300").stdout.strip()
    try:
        with _server(tmp_path, repo, nodes=1) as server:
            job = submit_run(server, _train_spec(name, dataset, epochs=1000, max_train_steps=1000))
            _wait_running(server, job)
            assert cancel_job(server, job) is True
            assert wait_job(server, job, timeout_s=60).state == "CANCELLED"
            assert cancel_job(server, job) is False  # ended: nothing is signalled again
            other = job_state(server, foreign)
            assert other is not None and other.name == name and other.state in ("RUNNING", "PENDING")
            assert check_slurm_released(server, job).passed
    finally:
        slurm_cluster.run("scancel", foreign, check=False)  # the test's own job, by its id


def test_a_dataset_that_does_not_match_its_sha256_trains_nothing(slurm_cluster, tmp_path, repo, dataset):
    with _server(tmp_path, repo, nodes=2) as server:
        job = submit_run(server, _train_spec("slurm-badsha", dataset, dataset_sha256="f" * 64))
        state = wait_job(server, job, timeout_s=120)
        assert (state.state, state.exit_code) == ("FAILED", "3:0")
        report = check_slurm_exit(server, job)
        assert "the dataset's SHA-256 did not match on a node: nothing was trained" in report.problems
        assert not server.exists(job.log_path)


@pytest.mark.slow
def test_readme_slurm_lab_smoke_trains_on_two_nodes_saves_and_resumes(slurm_cluster, tmp_path, dataset):
    import yaml

    lab = readme_lab("a Slurm cluster")
    server = lab["server"]
    assert server["scheduler"] == "slurm" and server["slurm"]["nodes"] == 2
    # This machine is the login node (the README: leave out host to submit from this machine); the
    # test cluster's partition, CPU nodes and memory replace the lab's; the keys stay the README's.
    for key in ("host", "user", "key_file", "known_hosts"):
        server.pop(key)
    assert server["repo_path"]  # where the README's example puts dpflow on the cluster; here, this checkout
    server.update(python=sys.executable, data_root=str(tmp_path / "shared"), repo_path=str(Path(__file__).parents[3]))
    server["slurm"].update(partition="debug", gpus_per_node=0, cpus_per_task=1, extra_sbatch=["--mem=200M"])
    server["slurm"].pop("account")  # the test cluster keeps no accounts
    assert set(server["slurm"]) == {"partition", "nodes", "gpus_per_node", "cpus_per_task", "time_limit", "extra_sbatch"}
    assert lab_servers(server).mode == "slurm"
    lab_file = tmp_path / "lab.yaml"
    lab_file.write_text(yaml.safe_dump(lab))
    path, sha = dataset
    common = ["--lab", str(lab_file), path, "--config-name", "tiny", "--batch-size", "4", "--json"]

    # `dpflow scale smoke` refuses a partition the cluster lacks before submitting anything; a smoke job
    # itself runs in the Dagster test below, through the same dpflow_core.runs.scale.slurm_smoke
    bad = yaml.safe_load(lab_file.read_text())
    bad["server"]["slurm"]["partition"] = "nosuch"
    bad_file = tmp_path / "bad-lab.yaml"
    bad_file.write_text(yaml.safe_dump(bad))
    proc, smoke = dpflow("scale", "smoke", "--lab", str(bad_file), path, "--config-name", "tiny", "--json", "--run-name", "readme-smoke")
    assert proc.returncode == 1 and smoke["passed"] is False and smoke["job_id"] is None, proc.stdout[-3000:]
    assert smoke["smoke_run"] is None  # nothing ran: no value to hand on
    assert [c[:2] for c in smoke["checks"]][0] == ["preflight partition", False] and "nosuch: not found" in smoke["checks"][0][2]
    assert "[FAIL] preflight partition: nosuch: not found" in proc.stdout
    assert not (tmp_path / "shared" / "runs" / "readme-smoke").exists()

    train = ["scale", "train", *common, "--run-name", "readme-2n", "--max-train-steps", "2", "--logging-mode", "disabled"]
    proc, first = dpflow(*train, "--epochs", "1")
    assert proc.returncode == 0 and first["passed"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert first["sha256"] == sha and (first["state"], first["exit_code"]) == ("COMPLETED", "0:0")
    run_dir = Path(first["run_dir"])
    script = (run_dir / "dpflow/launch-0/job.sbatch").read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --partition=debug", "#SBATCH --time=12:00:00", "#SBATCH --mem=200M",
                 "#SBATCH --job-name=readme-2n", "#SBATCH --cpus-per-task=1"):
        assert line in script
    ckpt = torch.load(run_dir / "checkpoints/latest.ckpt", weights_only=False, map_location="cpu")
    assert ckpt["num_processes"] == 2 and len(ckpt["rank_states"]) == 2
    assert (ckpt["epoch"], ckpt["global_step"]) == (1, 2)

    proc, second = dpflow(*train, "--epochs", "2", "--resume")
    assert proc.returncode == 0 and second["passed"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert second["run_dir"] == first["run_dir"] and second["job_id"] != first["job_id"]
    value = TrainResult.from_dict(second["train_run"])  # what the train_run asset hands on
    assert (value.launch_index, value.slurm_job_id, value.slurm_state, value.slurm_exit_code) == (1, second["job_id"], "COMPLETED", "0:0")
    assert (value.run_dir, value.epoch, value.global_step, value.scheduler) == (first["run_dir"], 1, 3, "slurm")
    last = torch.load(run_dir / "checkpoints/latest.ckpt", weights_only=False, map_location="cpu")
    assert (last["epoch"], last["global_step"]) == (2, 4) and last["num_processes"] == 2
    steps = [r for r in parse_log_text((run_dir / "logs.json.txt").read_text()) if not r.get("epoch_summary")]
    assert [r["global_step"] for r in steps] == [0, 1, 2, 3]
    assert "resumed from" in (run_dir / "dpflow/launch-1/output.log").read_text()
    for jid in (first["job_id"], second["job_id"]):
        assert _sacct(slurm_cluster, jid, "State,ExitCode,NNodes,NodeList") == "COMPLETED|0:0|2|n[1-2]"


def test_dagster_assets_run_smoke_and_training_as_slurm_jobs_and_download_the_checkpoint(slurm_cluster, tmp_path, repo, dataset):
    """remote_dataset, smoke_run, train_run and checkpoint materialized with the gpu_server resource set to the
    cluster (the lab.yaml's Slurm settings, field for field); ground truth from sacct and the files."""
    import dagster as dg
    from partitioned import materialize as materialize_task

    from dpflow_dagster.defs import remote as ar
    from dpflow_dagster.defs import training as at
    from dpflow_dagster.resources import GpuServerResource, SlurmConfig

    path, sha = dataset

    @dg.asset(name="dataset_npz", group_name="dataset")
    def dataset_npz_stub() -> dict:
        value = conversion_value(path, 10.0)
        assert value["sha256"] == sha
        return value

    gpu_server = GpuServerResource(
        scheduler="slurm", slurm=SlurmConfig(partition="debug", nodes=2, cpus_per_task=1, time_limit="10"),
        data_root=str(tmp_path / "shared"), repo_path=repo, python=sys.executable,
    )
    run_config = dg.RunConfig(ops={
        "smoke_run": at.SmokeRunConfig(run_name="dg-smoke", config_name="tiny", max_train_steps=2),
        "train_run": at.TrainRunConfig(run_name="dg-train", config_name="tiny", epochs=1, max_train_steps=2, batch_size=4,
                                       logging_mode="disabled"),
        "checkpoint": at.CheckpointConfig(output_dir=str(tmp_path / "checkpoints"), stable_interval_s=0.2),
    })
    assets = [dataset_npz_stub, ar.remote_dataset, ar.remote_dataset_sha256_match, at.smoke_run, at.smoke_run_released,
              at.train_run, at.train_run_natural_exit, at.checkpoint, at.checkpoint_sha256_match]
    instance = dg.DagsterInstance.ephemeral()
    result = materialize_task(assets, "pick_place", instance=instance, resources={"gpu_server": gpu_server}, run_config=run_config,
                              raise_on_error=False)
    failures = {e.step_key: e.step_failure_data.error.message if e.step_failure_data.error else ""
                for e in result.all_events if e.is_step_failure}
    assert result.success, failures
    meta = {e.asset_key.to_user_string(): {k: v.value for k, v in e.step_materialization_data.materialization.metadata.items()}
            for e in result.get_asset_materialization_events()}
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert {n: c.passed for n, c in checks.items()} == {
        "remote_dataset_sha256_match": True, "released": True, "natural_exit": True, "sha256_match": True}

    # the dataset on the cluster's shared file system, where the compute node's preflight found it
    remote = meta["remote_dataset"]["remote_path"]
    assert remote.startswith(str(tmp_path / "shared")) and sha256_file(remote) == sha
    smoke, train = meta["smoke_run"], meta["train_run"]
    assert smoke["scheduler"] == train["scheduler"] == "slurm"
    assert "| preflight dataset | yes |" in smoke["checks"] and f"SHA-256 {sha}" in smoke["checks"]
    # the job ids in the metadata are the jobs Slurm ran under the run names
    assert _sacct(slurm_cluster, smoke["slurm_job_id"], "JobName,State,ExitCode,NNodes") == "dg-smoke|COMPLETED|0:0|1"
    assert _sacct(slurm_cluster, train["slurm_job_id"], "JobName,State,ExitCode,NNodes") == "dg-train|COMPLETED|0:0|2"
    assert (train["slurm_state"], train["slurm_exit_code"], train["slurm_nodes"]) == ("COMPLETED", "0:0", 2)
    assert (train["epoch"], train["global_step"]) == (0, 1)
    record = json.loads((tmp_path / "shared/runs/dg-train/dpflow/launch-0" / SLURM_RECORD).read_text())
    assert record["job_id"] == train["slurm_job_id"] and record["nodes"] == 2
    assert "#SBATCH --time=10" in Path(train["slurm_script"]).read_text()
    exit_meta = {k: v.value for k, v in checks["natural_exit"].metadata.items()}
    assert exit_meta["slurm_job_id"] == train["slurm_job_id"] and exit_meta["job"].startswith(f"job {train['slurm_job_id']} COMPLETED")
    assert {k: v.value for k, v in checks["released"].metadata.items()}["slurm_job_id"] == smoke["slurm_job_id"]

    # the checkpoint downloaded is the one the 2-node job saved, by SHA-256 on both ends
    ckpt = meta["checkpoint"]
    saved = tmp_path / "shared" / "runs" / "dg-train" / "checkpoints" / "latest.ckpt"
    assert ckpt["remote_path"] == str(saved) and ckpt["sha256"] == ckpt["remote_sha256"] == sha256_file(saved)
    assert sha256_file(ckpt["local_path"]) == ckpt["sha256"] and ckpt["run_finished"] is True
    payload = torch.load(ckpt["local_path"], weights_only=False, map_location="cpu")
    assert payload["num_processes"] == 2 and (payload["epoch"], payload["global_step"]) == (1, 2)
    record = json.loads(Path(ckpt["record"]).read_text())
    assert record["slurm_job_id"] == train["slurm_job_id"]
    # the job's reproducibility record came with it, completed with Slurm's verdict
    assert (record["scheduler"], record["slurm_state"], record["exit_code"]) == ("slurm", "COMPLETED", "0:0")
    assert record["ended_at"] and record["started_at"] <= record["ended_at"]
    assert record["dataset"]["sha256"] == sha and record["slurm"]["nodes"] == 2 and record["kind"] == "train"
    assert any(line.startswith("torch==") for line in record["pip_freeze"])
    assert record["repo"]["path"] == repo and record["repo"]["commit"] == subprocess.run(
        ["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert record["command"] == json.loads((tmp_path / "shared/runs/dg-train/dpflow/launch-0" / SLURM_RECORD)
                                           .read_text())["command"]


def test_the_gpu_server_resource_is_the_lab_yaml_server_section(tmp_path, monkeypatch):
    """The resource's fields are the lab.yaml's keys; DPFLOW_LAB (how `dpflow demo --config` passes a cluster or
    several servers to the definitions) gives the machines lab_servers reads from the same file."""
    import yaml

    from dpflow_core.server.lab import CONNECTION_KEYS, SCALE_KEYS, SLURM_KEYS
    from dpflow_dagster import demo
    from dpflow_dagster.resources import GpuServerResource, HostConfig, SlurmConfig, gpu_server_from_env

    assert set(SlurmConfig.model_fields) == set(SLURM_KEYS)
    assert set(HostConfig.model_fields) == set(CONNECTION_KEYS)
    assert set(CONNECTION_KEYS) | set(SCALE_KEYS) <= set(GpuServerResource.model_fields)
    for title, mode in (("a Slurm cluster", "slurm"), ("two servers", "hosts")):
        lab = readme_lab(title)
        path = tmp_path / f"{mode}.yaml"
        path.write_text(yaml.safe_dump(lab))
        demo.check_lab_settings(lab, path)  # accepted by the demo, no longer refused
        monkeypatch.setenv("DPFLOW_LAB", str(path))
        resource = gpu_server_from_env()
        assert resource.lab() == lab_servers(lab["server"], path) and resource.lab().mode == mode
    assert [c.data_root for c in resource.lab().servers] == ["/data/dpflow", "/scratch/dpflow"]
    with pytest.raises(RemoteError, match=r"the gpu_server resource: server.slurm: slurm.time_limit 'soon' is not a Slurm time"):
        GpuServerResource(scheduler="slurm", slurm=SlurmConfig(time_limit="soon")).lab()
    path.write_text(yaml.safe_dump({"server": {"scheduler": "slurm", "slurm": {"gpus": 2}}}))
    with pytest.raises(RemoteError, match=rf"{path}: unknown key 'gpus' under 'server: slurm'"):
        gpu_server_from_env()
