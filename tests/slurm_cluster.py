"""A private Slurm cluster on loopback for tests (fixture ``slurm_cluster``).

Debian's ``slurm-wlm`` (22.05) and ``munge``, started as root by the fixture in a temporary folder:
one ``munged`` with its own key and socket, one ``slurmctld`` and two ``slurmd`` (nodes ``n1`` and
``n2``, both on 127.0.0.1 with their own ports: Debian builds Slurm with ``MULTIPLE_SLURMD``),
CPU-only nodes (no GRES), one partition ``debug``. Job accounting comes from
``JobCompType=jobcomp/filetxt``, read with ``sacct -c``. Every daemon runs in the foreground and is
stopped by its own PID when the session ends; nothing binds outside 127.0.0.1 (the nodes' and the
controller's addresses are 127.0.0.1, the ports free ones).

Usage in a test module::

    from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

A second kind, :func:`start_cluster` with ``limits=True`` (fixture ``slurm_limits_cluster`` in
``tests/core/runs/test_slurm_endings.py``), makes Slurm end jobs the ways a real cluster does: memory is a
consumable resource enforced by ``task/cgroup`` (``ConstrainRAMSpace``: the kernel's cgroup OOM
killer, which Slurm reports as ``OUT_OF_MEMORY``), and a partition ``urgent`` of a higher
``PriorityTier`` pre-empts ``debug`` jobs (``PreemptType=preempt/partition_prio``,
``PreemptMode=CANCEL``: ``PREEMPTED``). Its cgroup v1 memory hierarchy is this process's own
memory cgroup, bind-mounted under the cluster's folder inside each slurmd's own mount namespace
(``unshare --mount``: the mount ends with the daemon and no other process sees it), so the jobs'
cgroups nest inside the limits this machine already sets; its node names carry the PID, since
Slurm names its cgroups after the node (``slurm_<node>``), removed again at the end.

``SLURM_CONF`` is set in this process's environment while the cluster runs, so ``sbatch``,
``squeue``, ``sacct``, ``sinfo`` and ``scancel`` run by the local transport reach it. Missing
binaries skip the tests, or fail them when ``CI`` is set (:func:`conftest.require_service`).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import require_service

DAEMONS = ("munged", "slurmctld", "slurmd")
PARTITION = "debug"
NODES = ("n1", "n2")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class SlurmCluster:
    """A running test cluster."""

    root: Path
    conf: Path
    partition: str
    nodes: tuple[str, ...]

    def env(self) -> dict[str, str]:
        """The environment the Slurm commands need (``SLURM_CONF``)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run a Slurm command against this cluster."""
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, check=check, timeout=60)

    def logs(self) -> str:
        """The daemons' logs (for failure messages)."""
        return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.root.glob("*.log")))


#: Memory (MB) of each node of the ``limits`` cluster and a job's default share (jobs without ``--mem``).
LIMITS_NODE_MB, LIMITS_DEFAULT_MB = 8000, 2500
URGENT = "urgent"


def _config(root: Path, socket_path: Path, ctld_port: int, node_ports: dict[str, int], limits: bool = False) -> str:
    lines = [
        "ClusterName=dpflowtest",
        "SlurmctldHost=localhost(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={socket_path}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}/%n",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        f"TaskPlugin={'task/cgroup' if limits else 'task/none'}",
        "SelectType=select/cons_tres",
        f"SelectTypeParameters={'CR_Core_Memory' if limits else 'CR_Core'}",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SchedulerParameters=sched_interval=1",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={root / 'jobcomp.txt'}",
        "JobAcctGatherType=jobacct_gather/none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        "SlurmdParameters=config_overrides",
        "KillWait=5",
        "MinJobAge=300",
        "InactiveLimit=0",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
    ]
    if limits:
        lines += [f"DefMemPerCPU={LIMITS_DEFAULT_MB}", "PreemptType=preempt/partition_prio", "PreemptMode=CANCEL"]
    memory = LIMITS_NODE_MB if limits else 1000
    for name, port in node_ports.items():
        lines.append(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=2 RealMemory={memory} State=UNKNOWN"
        )
    nodes = ",".join(node_ports)
    lines.append(f"PartitionName={PARTITION} Nodes={nodes} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4"
                 + (" PriorityTier=1" if limits else ""))
    if limits:
        lines.append(f"PartitionName={URGENT} Nodes={nodes} MaxTime=INFINITE State=UP PriorityTier=2")
    return "\n".join(lines) + "\n"


def _memory_cgroup() -> Path:
    """This process's cgroup v1 memory folder (``/sys/fs/cgroup/memory/<path>``).

    Raises:
        RuntimeError: no cgroup v1 memory controller is mounted (a cgroup v2-only machine).
    """
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            folder = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            if (folder / "memory.limit_in_bytes").exists():
                return folder
    raise RuntimeError("no cgroup v1 memory controller mounted at /sys/fs/cgroup/memory")


def _remove_cgroups(folder: Path) -> None:
    """Remove the cgroup ``folder`` and those under it, deepest first (a cgroup is removed with rmdir once empty)."""
    if not folder.is_dir():
        return
    for sub in sorted([p for p in folder.rglob("*") if p.is_dir()] + [folder], key=lambda p: len(p.parts), reverse=True):
        try:
            sub.rmdir()
        except OSError:
            pass


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # by its own PID
    for proc in reversed(procs):
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def start_cluster(root: Path, *, limits: bool = False, nodes: tuple[str, ...] = NODES) -> tuple[SlurmCluster, list[subprocess.Popen]]:
    """Write keys and configs under ``root`` and start munged, slurmctld and the slurmd of each node.

    ``limits``: memory enforced by task/cgroup and pre-emption by partition priority (module docstring);
    each slurmd sees this process's memory cgroup at ``root/cgroup/memory`` (:func:`stop_cluster` removes what Slurm made in it).
    """
    procs: list[subprocess.Popen] = []
    keydir, sockdir = root / "munge-key", root / "munge-socket"
    keydir.mkdir(mode=0o700)
    sockdir.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    key = keydir / "munge.key"
    subprocess.run(["mungekey", "--create", "--keyfile", str(key)], check=True)
    socket_path = sockdir / "munge.socket"
    (root / "state").mkdir()
    (root / "spool").mkdir()
    for node in nodes:
        (root / "spool" / node).mkdir()
    node_ports = {node: _free_port() for node in nodes}
    conf = root / "slurm.conf"
    conf.write_text(_config(root, socket_path, _free_port(), node_ports, limits=limits))
    slurmd_prefix: list[str] = []
    if limits:
        mount = root / "cgroup" / "memory"
        mount.mkdir(parents=True)
        slurmd_prefix = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                         'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", str(_memory_cgroup()), str(mount)]
        (root / "cgroup.conf").write_text(  # read from beside slurm.conf
            f"CgroupPlugin=cgroup/v1\nCgroupMountpoint={root / 'cgroup'}\nCgroupAutomount=no\n"
            "ConstrainRAMSpace=yes\nConstrainSwapSpace=yes\nAllowedSwapSpace=0\n"
        )
    cluster = SlurmCluster(root=root, conf=conf, partition=PARTITION, nodes=nodes)
    env = cluster.env()
    try:
        procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
             f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
             f"--seed-file={root / 'munged.seed'}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        ))
        deadline = time.monotonic() + 10
        while not socket_path.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {cluster.logs()}")
            time.sleep(0.05)
        procs.append(subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", str(conf)], env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
        ))
        for node in nodes:
            procs.append(subprocess.Popen(
                [*slurmd_prefix, "slurmd", "-D", "-N", node, "-f", str(conf)], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
            ))
        deadline = time.monotonic() + 30
        while True:
            # one line per node and partition: a node in two partitions is listed twice
            states = dict(ln.split() for ln in cluster.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.splitlines()
                          if len(ln.split()) == 2)
            if sorted(states) == sorted(nodes) and all(s == "idle" for s in states.values()):
                break
            dead = [p.args[0] for p in procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Slurm cluster not idle (exited: {dead}, sinfo: {states}): {cluster.logs()}")
            time.sleep(0.1)
    except BaseException:
        stop_cluster(cluster, procs)
        raise
    return cluster, procs


def stop_cluster(cluster: SlurmCluster, procs: list[subprocess.Popen]) -> None:
    """Stop the daemons by their PIDs; for a ``limits`` cluster, remove the cgroups its nodes made."""
    _stop(procs)
    if (cluster.root / "cgroup").is_dir():
        for node in cluster.nodes:
            _remove_cgroups(_memory_cgroup() / f"slurm_{node}")


def _running_cluster(prefix: str, **options):
    """Start a cluster (:func:`start_cluster` ``options``) in a new folder, yield it with ``SLURM_CONF`` pointing
    at it, then restore ``SLURM_CONF``, stop the daemons and remove the folder."""
    root = Path(tempfile.mkdtemp(prefix=prefix))
    cluster, procs = start_cluster(root, **options)
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        stop_cluster(cluster, procs)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """The session's private Slurm cluster (2 CPU nodes on 127.0.0.1); ``SLURM_CONF`` points at it meanwhile."""
    missing = [d for d in DAEMONS + ("sbatch", "mungekey") if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        require_service("slurm", f"{', '.join(missing)} not found")
    if os.geteuid() != 0:
        require_service("slurm", "the test cluster's daemons run as root (SlurmUser=root)")
    yield from _running_cluster("dpflow-slurm-")


@pytest.fixture(scope="module")
def slurm_limits_cluster():
    """A private cluster that enforces memory (task/cgroup) and pre-empts (partition priority), one node; for one module."""
    missing = [d for d in DAEMONS + ("sbatch", "mungekey", "unshare") if shutil.which(d) is None and not os.path.exists(f"/usr/sbin/{d}")]
    if missing:
        require_service("slurm", f"{', '.join(missing)} not found")
    if os.geteuid() != 0:
        require_service("slurm", "the test cluster's daemons run as root and mount a cgroup hierarchy")
    try:
        _memory_cgroup()
    except RuntimeError as exc:
        require_service("slurm", f"memory enforcement needs cgroup v1's memory controller: {exc}")
    yield from _running_cluster("dpflow-slurm-limits-", limits=True, nodes=(f"lim{os.getpid()}",))
