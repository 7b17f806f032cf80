"""GpuServer over both transports: the local machine and a real sshd on 127.0.0.1.

Every test taking ``server`` runs twice, once per transport, through the same
code path. The SSH server is the real OpenSSH daemon of ``tests/sshd.py``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from conftest import kill_tmux_server, tmux_socket
from dpflow_core.errors import InvalidNameError, RemoteError
from dpflow_core.server import GpuServer, ServerConfig, parse_compute_apps, parse_gpu_query
from fake_nvidia_smi import H200_GPUS, write_fake_nvidia_smi
from sshd import sshd_server  # noqa: F401  (fixture)

TMUX_SOCKET = tmux_socket("remote")


@pytest.fixture(scope="module", autouse=True)
def _private_tmux_server():
    """Detached runs use a private tmux server; stop it (by its socket) afterwards."""
    yield
    kill_tmux_server(TMUX_SOCKET)


@pytest.fixture(params=["local", "ssh"])
def server(request, tmp_path):
    """A GpuServer on each transport with its data root under tmp_path."""
    data_root = tmp_path / "server"
    common = dict(data_root=str(data_root), python=sys.executable, tmux_socket=TMUX_SOCKET)
    if request.param == "local":
        config = ServerConfig.local(**common)
    else:
        config = request.getfixturevalue("sshd_server").server_config(**common)
    with GpuServer(config) as srv:
        yield srv


# ------------------------------------------------------------------ commands


def test_run_passes_arguments_verbatim(server):
    args = ["a b", "it's", "$HOME", "x; rm -rf ~", "`id`", "$(id)", "line1\nline2"]
    result = server.run(["printf", "%s|"] + args)
    assert result.ok and result.exit_code == 0
    assert result.stdout == "|".join(args) + "|"


def test_run_exit_code_stderr_and_check(server):
    result = server.run("echo out; echo err >&2; exit 7")
    assert (result.exit_code, result.stdout, result.stderr) == (7, "out\n", "err\n")
    assert not result.ok and not result.timed_out
    with pytest.raises(RemoteError) as info:
        server.run("echo boom >&2; exit 3", check=True)
    assert info.value.code == "command_failed" and "status 3" in str(info.value) and "boom" in str(info.value)


def test_run_env_and_cwd(server, tmp_path):
    result = server.run('printf "%s|%s" "$DPFLOW_X" "$(pwd)"', env={"DPFLOW_X": "a b; $(id)"}, cwd=str(tmp_path))
    assert result.stdout == f"a b; $(id)|{tmp_path}"
    with pytest.raises(RemoteError):
        server.run("true", env={"BAD-NAME": "x"})


def test_run_timeout_stops_the_command_and_its_children(server, tmp_path):
    pid_file = tmp_path / "child.pid"
    result = server.run(f"sh -c 'echo $$ > {pid_file}; exec sleep 60' ; true", timeout_s=1)
    assert result.timed_out and result.exit_code == 124
    assert result.duration_s < 10
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while server.pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not server.pid_alive(pid)


# --------------------------------------------------------------------- files


def test_put_get_roundtrip_and_no_overwrite(server, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    remote = server.put(src, str(tmp_path / "server" / "sub" / "copy.bin"))
    assert Path(remote).read_bytes() == src.read_bytes()
    assert not [p for p in Path(remote).parent.iterdir() if ".tmp-" in p.name]
    with pytest.raises(RemoteError) as info:
        server.put(src, remote)
    assert info.value.code == "exists"
    back = server.get(remote, tmp_path / "back" / "copy.bin")
    assert back.read_bytes() == src.read_bytes()
    with pytest.raises(RemoteError):
        server.get(remote, back)
    with pytest.raises(RemoteError) as info:
        server.get(str(tmp_path / "missing"), tmp_path / "x")
    assert info.value.code == "not_found"


def test_incremental_reads_keep_partial_lines(server, tmp_path):
    log = tmp_path / "logs.json.txt"
    log.write_text('{"step": 1}\n{"step": 2}\n{"ste')
    lines, offset = server.read_lines(str(log))
    assert lines == ['{"step": 1}', '{"step": 2}']
    assert offset == len('{"step": 1}\n{"step": 2}\n')
    with open(log, "a") as fh:
        fh.write('p": 3}\n')
    lines, offset2 = server.read_lines(str(log), offset)
    assert lines == ['{"step": 3}'] and offset2 == log.stat().st_size
    assert server.read_lines(str(log), offset2) == ([], offset2)
    chunk = server.read_from(str(log), 4, max_bytes=5)
    assert (chunk.data, chunk.offset, chunk.next_offset) == (log.read_bytes()[4:9], 4, 9)
    log.write_text("new\n")  # replaced: shorter than the offset
    chunk = server.read_from(str(log), offset2)
    assert chunk.restarted and chunk.data == b"new\n"
    assert server.tail(str(log), 2) == "w\n"


def test_write_text_exists_mkdir_listdir(server, tmp_path):
    folder = server.mkdir(str(tmp_path / "a" / "b"))
    assert Path(folder).is_dir() and server.exists(folder)
    path = server.write_text(f"{folder}/x.sh", "echo hi\n", mode=0o700)
    assert Path(path).read_text() == "echo hi\n" and (Path(path).stat().st_mode & 0o777) == 0o700
    assert server.listdir(folder) == ["x.sh"]
    assert server.listdir(str(tmp_path / "nope")) == []
    assert server.size(path) == 8 and server.size(str(tmp_path / "nope")) is None


def test_sha256_with_both_tools(server, tmp_path):
    data = os.urandom(2_500_000)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    expected = hashlib.sha256(data).hexdigest()
    assert server.sha256(str(path)) == expected
    assert server.sha256(str(path), tool="sha256sum") == expected
    assert server.sha256(str(path), tool="python") == expected
    with pytest.raises(RemoteError) as info:
        server.sha256(str(tmp_path / "missing.bin"))
    assert info.value.code == "not_found"


def test_free_disk_of_missing_path_measures_its_ancestor(server, tmp_path):
    st = os.statvfs(tmp_path)
    free_here = st.f_bavail * st.f_frsize
    measured = server.free_disk(str(tmp_path / "not" / "yet" / "there"))
    assert abs(measured - free_here) < 256 * 1024 * 1024  # others write to the same disk meanwhile


def test_paths_with_home_and_relative(server):
    import pwd

    # over SSH the home is the account's (passwd); locally it is $HOME
    home = pwd.getpwuid(os.getuid()).pw_dir if server.transport == "ssh" else os.path.expanduser("~")
    assert server.abspath("~/x/../y") == f"{home}/y"
    rel_base = home if server.transport == "ssh" else os.getcwd()
    assert server.abspath("a/b") == f"{rel_base}/a/b"


# ----------------------------------------------------------------- processes


def test_process_info_identifies_this_process(server):
    info = server.process_info(os.getpid())
    with open(f"/proc/{os.getpid()}/stat") as fh:
        start_ticks = int(fh.read().rpartition(")")[2].split()[19])
    with open(f"/proc/{os.getpid()}/cmdline", "rb") as fh:
        cmdline = tuple(a.decode() for a in fh.read().split(b"\0") if a)
    assert info.pid == os.getpid() and info.ppid == os.getppid() and info.pgid == os.getpgid(0)
    assert info.start_ticks == start_ticks and info.cmdline == cmdline and info.alive
    with open("/proc/stat") as fh:
        btime = next(int(line.split()[1]) for line in fh if line.startswith("btime"))
    assert info.start_time_s == pytest.approx(btime + start_ticks / os.sysconf("SC_CLK_TCK"))
    assert info.start_time_s <= time.time()
    assert server.process_info(_unused_pid()) is None
    assert not server.pid_alive(_unused_pid())


def _unused_pid() -> int:
    with open("/proc/sys/kernel/pid_max") as fh:
        pid = int(fh.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


@pytest.mark.parametrize("method", ["tmux", "setsid"])
def test_detached_run_records_exit_status(server, tmp_path, method):
    name = f"run-{method}-{uuid.uuid4().hex[:6]}.v1"
    state = str(tmp_path / "state")
    proc = server.start_detached(
        name, 'echo "start $DPFLOW_RUN $(pwd)"; echo oops >&2; sleep 0.5; exit 3',
        state_dir=state, cwd=str(tmp_path), env={"DPFLOW_RUN": name}, method=method,
    )
    assert proc.method == method and proc.leader.pid == proc.leader.pgid == proc.leader.sid
    assert proc.tmux_session == (name.replace(".", "_") if method == "tmux" else None)
    status = server.wait_detached(proc, timeout_s=30, poll_s=0.1)
    assert status.exit_code == 3 and status.finished and not status.leader_alive
    assert status.members == ()
    assert Path(proc.log_path).read_text() == f"start {name} {tmp_path}\noops\n"
    assert server.load_detached(state, name) == proc
    if method == "tmux":
        assert not server.tmux_session_exists(proc.tmux_session)
    with pytest.raises(RemoteError) as info:
        server.start_detached(name, "true", state_dir=state, method=method)
    assert info.value.code == "already_started"


@pytest.mark.parametrize("method", ["tmux", "setsid"])
def test_a_run_launched_while_term_is_ignored_still_stops_on_term(server, tmp_path, method):
    """An in-process Dagster materialisation leaves SIGTERM ignored in its process, and a shell cannot reset a
    signal ignored on entry: the command must still get TERM's default action (exit 143), not need a KILL."""
    import signal as sig

    previous = sig.signal(sig.SIGTERM, sig.SIG_IGN)
    try:
        name = f"ignored-{method}-{uuid.uuid4().hex[:6]}"
        proc = server.start_detached(name, ["sh", "-c", "sleep 60; echo never"], state_dir=str(tmp_path), method=method)
    finally:
        sig.signal(sig.SIGTERM, previous)
    assert server.signal_group(proc.leader, "TERM") is True
    status = server.wait_detached(proc, timeout_s=20, poll_s=0.1)
    assert status.exit_code == 143 and not status.leader_alive and status.members == ()


def test_detached_run_is_terminated_by_identity_only(server, tmp_path):
    name = f"sleeper-{uuid.uuid4().hex[:6]}"
    proc = server.start_detached(name, ["sh", "-c", "sleep 60; echo never"], state_dir=str(tmp_path), method="auto")
    status = server.detached_status(proc)
    assert status.leader_alive and status.exit_code is None
    assert proc.pid in status.members and len(status.members) >= 2  # wrapper + command (+ sleep)
    impostor = type(proc.leader)(**{**proc.leader.__dict__, "start_ticks": proc.leader.start_ticks + 1})
    assert server.signal_group(impostor, "TERM") is False
    assert server.signal_process(impostor, "TERM") is False
    assert server.detached_status(proc).leader_alive
    assert server.signal_group(proc.leader, "TERM") is True
    status = server.wait_detached(proc, timeout_s=20, poll_s=0.1)
    assert status.exit_code == 143 and not status.leader_alive and status.members == ()
    assert "never" not in Path(proc.log_path).read_text()
    assert server.signal_process(proc.leader, "KILL") is False  # gone: nothing to signal


def test_detached_names_are_validated_before_anything_runs(tmp_path):
    closed = ServerConfig(host="127.0.0.1", port=_closed_port(), known_hosts=str(tmp_path / "kh"))
    with GpuServer(closed) as srv:
        for bad in ["x; rm -rf ~", "../../etc", "a/b", "-rf", "$(id)", "", "a" * 200]:
            with pytest.raises(InvalidNameError):
                srv.start_detached(bad, "true", state_dir=str(tmp_path))


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------- GPUs


def test_gpu_query_parsing_from_fake_nvidia_smi(tmp_path):
    smi = write_fake_nvidia_smi(
        tmp_path, gpus=H200_GPUS + ("2, GPU-mig-1, NVIDIA H200, 143771, [N/A], [Not Supported]",)
    )
    out = subprocess.run(
        [str(smi), "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout
    gpus = parse_gpu_query(out)
    assert [(g.index, g.name, g.memory_total_mib, g.memory_used_mib, g.utilization_pct) for g in gpus] == [
        (0, "NVIDIA H200", 143771, 20905, 87), (1, "NVIDIA H200", 143771, 1, 0), (2, "NVIDIA H200", 143771, None, None),
    ]
    assert gpus[0].uuid == "GPU-5b8a8f2c-1d3e-4c7e-9a8b-0f1e2d3c4b5a"
    apps = parse_compute_apps("48213, GPU-a, 20480, /usr/bin/python3 train.py, x=1\n\n")
    assert apps[0].pid == 48213 and apps[0].used_memory_mib == 20480
    assert apps[0].process_name == "/usr/bin/python3 train.py, x=1"
    assert parse_compute_apps("") == ()
    with pytest.raises(RemoteError):
        parse_gpu_query("garbage line\n")


def test_gpu_inventory_states(server, tmp_path):
    assert server.config.nvidia_smi == "nvidia-smi"
    absent = GpuServer(_with(server.config, nvidia_smi=str(tmp_path / "absent" / "nvidia-smi")))
    inv = absent.gpu_inventory()
    assert inv.status == "no_gpu" and inv.gpus == () and "no GPU" in inv.message and inv.exit_code == 127

    fake = write_fake_nvidia_smi(tmp_path / "ok")
    with GpuServer(_with(server.config, nvidia_smi=str(fake))) as srv:
        inv = srv.gpu_inventory()
    assert inv.status == "ok" and [g.index for g in inv.gpus] == [0, 1]
    assert [p.pid for p in inv.processes_on(inv.gpus[0].uuid)] == [48213]
    assert inv.processes_on(inv.gpus[1].uuid) == ()

    broken = write_fake_nvidia_smi(tmp_path / "broken", fail=True)
    with GpuServer(_with(server.config, nvidia_smi=str(broken))) as srv:
        inv = srv.gpu_inventory()
    assert inv.status == "error" and inv.exit_code == 9 and "exited with status 9" in inv.message
    assert inv.stderr.startswith("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver")
    assert inv.command == f"{broken} --query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu --format=csv,noheader,nounits"


def _with(config: ServerConfig, **changes) -> ServerConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


# ------------------------------------------------------------------ security


@pytest.mark.sshd
def test_unknown_host_key_is_refused(sshd_server, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    marker = tmp_path / "ran"
    with GpuServer(sshd_server.server_config(known_hosts=str(known_hosts))) as srv:
        with pytest.raises(RemoteError) as info:
            srv.run(f"touch {marker}")
    assert info.value.code == "unknown_host_key"
    assert not marker.exists() and known_hosts.read_text() == ""


@pytest.mark.sshd
def test_changed_host_key_is_refused_even_with_trust_on_first_use(sshd_server, tmp_path):
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    fake_key = " ".join(Path(f"{other}.pub").read_text().split()[:2])
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[{sshd_server.host}]:{sshd_server.port} {fake_key}\n")
    marker = tmp_path / "ran"
    config = sshd_server.server_config(known_hosts=str(known_hosts), trust_on_first_use=True)
    with GpuServer(config) as srv, pytest.raises(RemoteError) as info:
        srv.run(f"touch {marker}")
    assert info.value.code == "host_key_mismatch" and not marker.exists()


@pytest.mark.sshd
def test_trust_on_first_use_records_the_key(sshd_server, tmp_path):
    known_hosts = tmp_path / "ssh" / "known_hosts"
    with GpuServer(sshd_server.server_config(known_hosts=str(known_hosts), trust_on_first_use=True)) as srv:
        assert srv.run("echo ok").stdout == "ok\n"
    assert known_hosts.read_text() == sshd_server.known_hosts_line()
    with GpuServer(sshd_server.server_config(known_hosts=str(known_hosts))) as srv:  # now known: strict mode works
        assert srv.run("echo again").stdout == "again\n"


@pytest.mark.sshd
def test_wrong_user_key_is_refused(sshd_server, tmp_path):
    other = tmp_path / "id_other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    with GpuServer(sshd_server.server_config(key_filename=str(other))) as srv, pytest.raises(RemoteError) as info:
        srv.run("true")
    assert info.value.code == "auth_failed"


def test_unreachable_host_is_reported(tmp_path):
    config = ServerConfig(host="127.0.0.1", port=_closed_port(), known_hosts=str(tmp_path / "kh"), connect_timeout_s=5)
    with GpuServer(config) as srv, pytest.raises(RemoteError) as info:
        srv.run("true")
    assert info.value.code == "unreachable"


@pytest.mark.parametrize("field,value", [
    ("host", "-oProxyCommand=touch /tmp/x"), ("host", "a b"), ("user", "root; id"), ("port", 0), ("port", 70000),
    ("tmux_socket", "../x"),
])
def test_config_rejects_option_and_shell_shaped_values(field, value):
    with pytest.raises((RemoteError, InvalidNameError)):
        ServerConfig(**{"host": "example.org", field: value})


def test_python_setting_cannot_inject_shell(server, tmp_path):
    marker = tmp_path / "pwned"
    srv = GpuServer(_with(server.config, python=f"{sys.executable}; touch {marker}"))
    result = srv.run(srv.python_command(["-c", "print(1)"]))
    assert not result.ok and not marker.exists()
    ok = GpuServer(_with(server.config, python=f"env DPFLOW_Y=1 {sys.executable}"))
    assert ok.run(ok.python_command(["-c", "import os; print(os.environ['DPFLOW_Y'])"])).stdout == "1\n"
