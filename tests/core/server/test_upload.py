"""Resumable, SHA-256-verified dataset upload over both transports and both methods.

The SSH transport talks to the real sshd of ``tests/sshd.py``; rsync runs over
``ssh`` with the same key and known_hosts file. An interrupted upload is a
real ``dpflow upload`` process killed halfway through a bandwidth-limited
transfer.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpflow_core.server import paths as server_paths
from dpflow_core.errors import DatasetError, InvalidNameError, RemoteError
from dpflow_core.server import GpuServer, ServerConfig
from dpflow_core.server.upload import remote_dataset_path, task_for_dataset, upload_dataset, verify_remote_file
from sshd import sshd_server  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[3]
SIZE = 3_000_000


@pytest.fixture(params=["local", "ssh"])
def transport(request):
    return request.param


@pytest.fixture
def server_config(request, transport, tmp_path):
    data_root = tmp_path / "server root"  # a space: paths must be quoted everywhere
    if transport == "local":
        return ServerConfig.local(data_root=str(data_root))
    return request.getfixturevalue("sshd_server").server_config(data_root=str(data_root), python=sys.executable)


def _random_npz(path: Path, n_bytes: int) -> Path:
    """An uncompressed npz of ``n_bytes`` in all, random data (upload checks the archive's CRC-32s),
    with the sidecar that records its SHA-256, as conversion writes it."""
    import io

    import numpy as np

    def npz(payload: int) -> bytes:
        buf = io.BytesIO()
        np.savez(buf, data=np.frombuffer(os.urandom(payload), dtype=np.uint8))
        return buf.getvalue()

    path.write_bytes(npz(2 * n_bytes - len(npz(n_bytes))))
    assert path.stat().st_size == n_bytes
    path.with_suffix(".json").write_text(json.dumps({"sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    return path


@pytest.fixture
def dataset(tmp_path) -> Path:
    path = tmp_path / "pick_place" / "dataset.npz"
    path.parent.mkdir()
    return _random_npz(path, SIZE)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dpflow(*args: str, **kw) -> list[str]:
    return [sys.executable, "-c", "from dpflow_core.cli import main; main()", *args]


@pytest.mark.parametrize("method", ["rsync", "stream"])
def test_upload_is_content_addressed_verified_and_idempotent(server_config, dataset, method, tmp_path):
    digest = _sha(dataset)
    seen = []
    with GpuServer(server_config) as server:
        result = upload_dataset(server, dataset, method=method, expected_sha256=digest,
                                progress=lambda done, total: seen.append((done, total)))
        expected_path = os.path.join(server_config.data_root, "pick_place", digest[:16], "dataset.npz")
        assert result.remote_path == expected_path == remote_dataset_path(server, "pick_place", digest)
        assert result.verified and result.verification.remote_sha256 == digest == result.sha256
        assert result.verification.remote_size == SIZE == result.size_bytes
        assert result.method == {"rsync": "rsync", "stream": "sftp" if server.transport == "ssh" else "copy"}[method]
        assert (result.resumed_from_bytes, result.bytes_sent, result.already_present) == (0, SIZE, False)
        assert Path(expected_path).read_bytes() == dataset.read_bytes()
        assert os.listdir(os.path.dirname(expected_path)) == ["dataset.npz"]  # no .partial left
        assert seen and seen[-1] == (SIZE, SIZE)
        assert result.to_remote_dataset(29.97).to_dict() == {
            "remote_path": expected_path, "sha256": digest, "size_bytes": SIZE,
            "host": server_config.host, "frequency_hz": 29.97, "local_path": str(dataset.resolve()), "remote_paths": [],
        }
        mtime = os.stat(expected_path).st_mtime_ns

        again = upload_dataset(server, dataset, method=method)
        assert again.already_present and again.verified and again.method == "none" and again.bytes_sent == 0
        assert os.stat(expected_path).st_mtime_ns == mtime

        other = tmp_path / "other" / "dataset.npz"
        other.parent.mkdir()
        _random_npz(other, 1000)
        second = upload_dataset(server, other, task="pick_place", method=method)
        assert second.verified and os.path.dirname(second.remote_path) != os.path.dirname(expected_path)
        assert Path(expected_path).read_bytes() == dataset.read_bytes()  # never overwritten


@pytest.mark.parametrize("method", ["rsync", "stream"])
def test_upload_resumes_a_partial_file(server_config, dataset, method):
    with GpuServer(server_config) as server:
        final = remote_dataset_path(server, "pick_place", _sha(dataset))
        os.makedirs(os.path.dirname(final))
        Path(final + ".partial").write_bytes(dataset.read_bytes()[:1_234_567])
        result = upload_dataset(server, dataset, method=method)
    assert result.verified and result.resumed_from_bytes == 1_234_567
    assert result.bytes_sent == SIZE - 1_234_567
    assert Path(final).read_bytes() == dataset.read_bytes() and not Path(final + ".partial").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["rsync", "stream"])
def test_upload_killed_halfway_then_resumed(request, transport, server_config, dataset, method, tmp_path):
    """A real `dpflow upload` process is killed mid-transfer; the next upload continues from its bytes."""
    connection = ["--remote-dir", server_config.data_root]
    if transport == "ssh":
        connection += request.getfixturevalue("sshd_server").cli_args()
    digest = _sha(dataset)
    with GpuServer(server_config) as server:
        partial = Path(remote_dataset_path(server, "pick_place", digest) + ".partial")
    proc = subprocess.Popen(
        _dpflow("upload", str(dataset), "--method", method, "--bwlimit", "1000", *connection),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if partial.exists() and partial.stat().st_size >= 600_000:
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    os.killpg(proc.pid, signal.SIGKILL)  # the uploader, and rsync/ssh it started: our own process group
    proc.wait(10)
    time.sleep(0.5)  # the server side notices the closed connection and stops writing
    data = partial.read_bytes()
    kept = len(data)
    assert 0 < kept < SIZE and data == dataset.read_bytes()[:kept]

    with GpuServer(server_config) as server:
        result = upload_dataset(server, dataset, method=method)
    assert result.verified and result.resumed_from_bytes == kept and result.bytes_sent == SIZE - kept
    assert Path(result.remote_path).read_bytes() == dataset.read_bytes()


@pytest.mark.parametrize("method", ["rsync", "stream"])
def test_corrupted_partial_is_caught_and_quarantined(server_config, dataset, method):
    """Resume by size trusts the bytes there; the SHA-256 check on the server catches a flipped byte."""
    digest = _sha(dataset)
    with GpuServer(server_config) as server:
        final = remote_dataset_path(server, "pick_place", digest)
        os.makedirs(os.path.dirname(final))
        corrupted = bytearray(dataset.read_bytes())
        corrupted[SIZE // 2] ^= 0x01
        Path(final + ".partial").write_bytes(corrupted)
        result = upload_dataset(server, dataset, method=method)
    bad_sha = hashlib.sha256(corrupted).hexdigest()
    v = result.verification
    assert not result.verified
    assert (v.local_sha256, v.remote_sha256, v.local_size, v.remote_size) == (digest, bad_sha, SIZE, SIZE)
    assert not Path(final).exists() and not Path(final + ".partial").exists()
    assert v.quarantine_path.startswith(final + ".quarantine-") and v.quarantine_path.endswith(bad_sha[:12])
    assert Path(v.quarantine_path).read_bytes() == bytes(corrupted)
    assert result.quarantined == (v.quarantine_path,)

    with GpuServer(server_config) as server:  # a new upload starts clean and succeeds
        retry = upload_dataset(server, dataset, method=method)
    assert retry.verified and retry.resumed_from_bytes == 0 and Path(final).read_bytes() == dataset.read_bytes()


def test_later_corruption_caught_by_verification_and_healed_by_reupload(server_config, dataset):
    digest = _sha(dataset)
    with GpuServer(server_config) as server:
        final = upload_dataset(server, dataset).remote_path
        with open(final, "r+b") as fh:  # one byte flipped on the server after the upload
            fh.seek(12345)
            byte = fh.read(1)
            fh.seek(12345)
            fh.write(bytes([byte[0] ^ 0xFF]))
        check = verify_remote_file(server, final, digest, SIZE)
        assert not check.match and check.remote_sha256 != digest and check.remote_size == SIZE
        assert check.quarantine_path and Path(check.quarantine_path).exists() and not Path(final).exists()
        assert not verify_remote_file(server, final, digest, SIZE).match  # missing now: never "passes"

        Path(check.quarantine_path).rename(final)  # corrupted file back in place: upload quarantines, re-sends
        healed = upload_dataset(server, dataset)
    assert healed.verified and not healed.already_present and len(healed.quarantined) == 1
    assert Path(final).read_bytes() == dataset.read_bytes()


def test_upload_refuses_when_the_dataset_does_not_fit(server_config, dataset, monkeypatch):
    monkeypatch.setattr(server_paths, "DISK_MARGIN_MIN_BYTES", 1 << 62)
    with GpuServer(server_config) as server:
        with pytest.raises(RemoteError) as info:
            upload_dataset(server, dataset)
        final = remote_dataset_path(server, "pick_place", _sha(dataset))
    assert info.value.code == "insufficient_disk" and "only" in str(info.value)
    assert not Path(final).exists() and not Path(final + ".partial").exists()


def test_upload_refuses_a_dataset_changed_since_conversion(server_config, dataset):
    with GpuServer(server_config) as server, pytest.raises(DatasetError) as info:
        upload_dataset(server, dataset, expected_sha256="0" * 64)
    assert info.value.code == "sha256_changed" and _sha(dataset) in str(info.value)


@pytest.mark.parametrize("bad", ["x; rm -rf ~", "../../etc", "a/b", "$(touch pwned)", "-rf", ".hidden"])
def test_injection_shaped_task_is_rejected_before_connecting(dataset, tmp_path, bad):
    closed = ServerConfig(host="127.0.0.1", port=1, known_hosts=str(tmp_path / "kh"), data_root="/tmp/x")
    with GpuServer(closed) as server, pytest.raises(InvalidNameError):
        upload_dataset(server, dataset, task=bad)


def test_shell_syntax_in_the_data_root_stays_literal(server_config, dataset, tmp_path):
    root = tmp_path / "root $(touch pwned) `touch pwned2`; x"
    config = ServerConfig(**{**server_config.__dict__, "data_root": str(root)})
    with GpuServer(config) as server:
        for method in ("rsync", "stream"):
            result = upload_dataset(server, dataset, task=f"t-{method}", method=method)
            assert result.verified and Path(result.remote_path).read_bytes() == dataset.read_bytes()
    assert not list(tmp_path.rglob("pwned*")) and not list(Path.cwd().glob("pwned*"))


@pytest.mark.sshd
def test_upload_to_unknown_host_key_is_refused(sshd_server, dataset, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    data_root = tmp_path / "never"
    with GpuServer(sshd_server.server_config(known_hosts=str(known_hosts), data_root=str(data_root))) as server:
        with pytest.raises(RemoteError) as info:
            upload_dataset(server, dataset)
    assert info.value.code == "unknown_host_key" and not data_root.exists()


def test_task_comes_from_the_sidecar_else_the_folder(tmp_path):
    ds = tmp_path / "cup_stack" / "dataset.npz"
    ds.parent.mkdir()
    ds.write_bytes(b"x")
    assert task_for_dataset(ds) == "cup_stack"
    ds.with_suffix(".json").write_text(json.dumps({"task": "pick_place"}))
    assert task_for_dataset(ds) == "pick_place"
    ds.with_suffix(".json").write_text(json.dumps({"task": "../etc"}))
    with pytest.raises(InvalidNameError):
        task_for_dataset(ds)
    odd = tmp_path / "has space" / "d.npz"
    odd.parent.mkdir()
    odd.write_bytes(b"x")
    assert task_for_dataset(odd) == "dataset"


def test_cli_upload_prints_the_verified_sha256(request, transport, server_config, dataset):
    args = ["upload", str(dataset), "--remote-dir", server_config.data_root]
    if transport == "ssh":
        args += request.getfixturevalue("sshd_server").cli_args()
    out = subprocess.run(_dpflow(*args), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    digest = _sha(dataset)
    assert out.stdout.startswith(f"verified sha256 {digest}  ")
    assert (server_config.describe() if transport == "ssh" else "local") in out.stdout
    assert Path(server_config.data_root, "pick_place", digest[:16], "dataset.npz").read_bytes() == dataset.read_bytes()

    as_json = subprocess.run(_dpflow(*args, "--json"), cwd=REPO, capture_output=True, text=True, timeout=120)
    data = json.loads(as_json.stdout)
    assert data["verified"] and data["already_present"] and data["sha256"] == digest


def test_cli_upload_mismatch_exits_nonzero_with_both_hashes(server_config, dataset, transport, request):
    digest = _sha(dataset)
    final = Path(server_config.data_root, "pick_place", digest[:16], "dataset.npz")
    final.parent.mkdir(parents=True)
    corrupted = bytearray(dataset.read_bytes())
    corrupted[0] ^= 0xFF
    Path(str(final) + ".partial").write_bytes(corrupted)
    args = ["upload", str(dataset), "--remote-dir", server_config.data_root, "--method", "stream"]
    if transport == "ssh":
        args += request.getfixturevalue("sshd_server").cli_args()
    out = subprocess.run(_dpflow(*args), cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert digest in out.stderr and hashlib.sha256(corrupted).hexdigest() in out.stderr
    assert "quarantine" in out.stderr and not final.exists()


def test_cli_upload_takes_the_server_from_a_lab_yaml(sshd_server, dataset, tmp_path):
    import yaml

    data_root = tmp_path / "lab root"
    lab = tmp_path / "lab.yaml"
    lab.write_text(yaml.safe_dump({"server": {
        "host": sshd_server.host, "port": sshd_server.port, "user": sshd_server.user, "key_file": str(sshd_server.key_path),
        "known_hosts": str(sshd_server.known_hosts), "data_root": str(data_root), "python": sys.executable,
    }}))
    # the lab.yaml wins over the DPFLOW_SERVER_* variables a lab sets for Dagster
    env = {**os.environ, "DPFLOW_SERVER_ROOT": str(tmp_path / "elsewhere"), "DPFLOW_SERVER_HOST": "other.example"}
    out = subprocess.run(_dpflow("upload", str(dataset), "--lab", str(lab)), cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "elsewhere").exists()
    digest = _sha(dataset)
    assert out.stdout.startswith(f"verified sha256 {digest}  ") and f"{sshd_server.user}@{sshd_server.host}" in out.stdout
    assert (data_root / "pick_place" / digest[:16] / "dataset.npz").read_bytes() == dataset.read_bytes()

    # one source of the server: --lab with a connection flag is refused before connecting
    both = subprocess.run(_dpflow("upload", str(dataset), "--lab", str(lab), "--host", "elsewhere"), cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert both.returncode == 2 and "--host would change it: give one or the other" in both.stderr
    # a Slurm section is `dpflow scale`'s
    lab.write_text(yaml.safe_dump({"server": {"scheduler": "slurm", "slurm": {"nodes": 2}}}))
    slurm = subprocess.run(_dpflow("upload", str(dataset), "--lab", str(lab)), cwd=REPO, capture_output=True, text=True,
                           timeout=60)
    assert slurm.returncode == 2
    assert f"error: {lab}: its server: section is a Slurm cluster; run it with `dpflow scale smoke|train --lab {lab} DATASET`" \
        in slurm.stderr
