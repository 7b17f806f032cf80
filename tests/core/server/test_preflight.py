"""Preflight over both transports: repository, Python/torch, nproc, disk, GPUs (fake nvidia-smi)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpflow_core.server.preflight import preflight
from dpflow_core.server import GpuServer, ServerConfig
from fake_nvidia_smi import write_fake_nvidia_smi
from sshd import sshd_server  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[3]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture(scope="module")
def training_repo(tmp_path_factory) -> tuple[Path, str]:
    """A git repository on branch ``feature-x`` with one modified and one untracked file."""
    repo = tmp_path_factory.mktemp("trainer")
    _git(repo, "init", "-q", "-b", "feature-x")
    (repo / "train.py").write_text("print('train')\n")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-q", "-m", "trainer")
    commit = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "train.py").write_text("print('changed')\n")
    (repo / "notes.txt").write_text("untracked\n")
    return repo, commit


@pytest.fixture(params=["local", "ssh"])
def make_config(request, tmp_path, training_repo):
    def make(**changes) -> ServerConfig:
        values = dict(data_root=str(tmp_path / "root"), python=sys.executable, repo_path=str(training_repo[0]),
                      nvidia_smi=str(write_fake_nvidia_smi(tmp_path / "smi")))
        values.update(changes)
        if request.param == "local":
            return ServerConfig.local(**values)
        return request.getfixturevalue("sshd_server").server_config(**values)

    make.transport = request.param
    return make


def test_preflight_reports_repo_python_nproc_disk_and_gpus(make_config, training_repo, tmp_path):
    with GpuServer(make_config()) as server:
        report = preflight(server, dataset_size_bytes=5_000_000, dataset_sha256="ab" * 32, task="pick_place")
    repo, commit = training_repo
    assert report.transport == make_config.transport
    assert (report.repo.path, report.repo.branch, report.repo.commit) == (str(repo), "feature-x", commit)
    assert sorted(report.repo.dirty_files) == [" M train.py", "?? notes.txt"]
    assert report.python.executable == sys.executable
    assert report.python.python_version == ".".join(map(str, sys.version_info[:3]))
    assert report.python.torch_version.split("+")[0] == importlib.metadata.version("torch").split("+")[0]
    assert report.python.cuda_available is False and report.python.cuda_device_count == 0  # CPU machine
    assert report.nproc == len(os.sched_getaffinity(0))
    st = os.statvfs(tmp_path)
    assert abs(report.disk.free_bytes - st.f_bavail * st.f_frsize) < 256 * 1024 * 1024
    assert report.disk.fits is True and report.disk.required_bytes > 5_000_000
    assert report.dataset_present is False
    assert report.dataset_remote_path == str(tmp_path / "root" / "pick_place" / ("ab" * 8) / "dataset.npz")
    assert report.gpus.status == "ok" and [g.index for g in report.gpus.gpus] == [0, 1]
    assert report.ok and report.problems == ()
    assert any("uncommitted" in w for w in report.warnings)
    assert any("already on GPU(s) GPU-5b8a8f2c" in w for w in report.warnings)
    meta = report.to_metadata()
    assert meta["preflight/repo_commit"] == commit and meta["preflight/gpu_count"] == 2
    assert "| 0 | NVIDIA H200 |" in report.gpu_markdown() and "48213" in report.gpu_markdown()
    json.dumps(report.to_dict())


def test_no_gpu_is_reported_not_passed(make_config, tmp_path):
    with GpuServer(make_config(nvidia_smi=str(tmp_path / "none" / "nvidia-smi"))) as server:
        report = preflight(server)
    assert report.gpus.status == "no_gpu" and report.gpus.gpus == ()
    if make_config.transport == "ssh":  # a GPU is expected over SSH: a blocking problem
        assert not report.ok and any(p.startswith("gpu: GPU expected on this server but no GPU") for p in report.problems)
    else:
        assert report.ok and any(w.startswith("no GPU") for w in report.warnings)
    assert report.to_metadata()["preflight/gpu_status"] == "no_gpu"
    assert report.gpu_markdown().startswith("**no_gpu**")
    assert report.disk.fits is None and report.dataset_present is None  # nothing asked about a dataset


def test_dataset_that_does_not_fit_is_a_problem(make_config, tmp_path):
    st = os.statvfs(tmp_path)
    too_big = st.f_bavail * st.f_frsize + 1
    with GpuServer(make_config()) as server:
        report = preflight(server, dataset_size_bytes=too_big)
    assert not report.ok and report.disk.fits is False
    assert any(p.startswith("disk:") for p in report.problems)


def test_missing_python_and_missing_repo_are_reported(make_config, tmp_path):
    with GpuServer(make_config(python=str(tmp_path / "no-python"), repo_path=str(tmp_path / "no-repo"))) as server:
        report = preflight(server)
    assert not report.ok and any(p.startswith("python:") for p in report.problems)
    assert report.python.torch_version is None and report.repo.error
    assert any(w.startswith("repository:") for w in report.warnings)


def test_present_dataset_is_found_by_content_address(make_config, tmp_path):
    config = make_config()
    digest = "cd" * 32
    target = Path(config.data_root, "pick_place", digest[:16], "dataset.npz")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"x" * 10)
    with GpuServer(config) as server:
        report = preflight(server, dataset_size_bytes=10, dataset_sha256=digest, task="pick_place")
    assert report.dataset_present and report.dataset_remote_path == str(target)


@pytest.mark.slow
def test_cli_preflight(make_config, request, tmp_path, training_repo):
    config = make_config()
    connection = ["--remote-dir", config.data_root, "--remote-repo", config.repo_path]
    if make_config.transport == "ssh":
        connection += request.getfixturevalue("sshd_server").cli_args()
    run = [sys.executable, "-c", "from dpflow_core.cli import main; main()", "preflight", *connection]
    out = subprocess.run(run + ["--json", "--python", sys.executable, "--no-expect-gpu"], cwd=REPO, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["ok"] and data["transport"] == make_config.transport
    assert data["repo"]["commit"] == training_repo[1] and data["nproc"] == len(os.sched_getaffinity(0))
    assert data["gpus"]["status"] == "no_gpu"  # the CLI uses the real nvidia-smi name: none here

    bad = subprocess.run(run + ["--python", str(tmp_path / "no-python"), "--no-expect-gpu"], cwd=REPO, capture_output=True,
                         text=True, timeout=180, env={**os.environ, "COLUMNS": "500"})  # no wrapped cells
    assert bad.returncode == 1, bad.stderr
    assert "feature-x" in bad.stdout and "problem" in bad.stdout and "no-python" in bad.stdout
