"""The GPU server: the machine that trains, reached over SSH or used locally.

One interface, :class:`GpuServer`, with two transports that share every code
path above the three primitives they provide (run a shell script, open a
file, close):

* SSH through Fabric (:class:`fabric.Connection`, Paramiko underneath) when
  :attr:`ServerConfig.host` is set. Host keys are checked against a
  known_hosts file; an unknown key is refused unless
  :attr:`ServerConfig.trust_on_first_use` is set explicitly, a changed key is
  always refused. SSH config files are not read, so what runs is what the
  configuration says.
* The local machine through Invoke (Fabric's own local runner) when no host
  is configured: the embedded default.

Everything that reaches a remote shell is either a fixed string of this
module or passed through :func:`shlex.quote`; names (task, run, stem) are
checked with :func:`dpflow_core.names.validate_name` before anything runs.

Process queries read ``/proc`` (the server is Linux). A detached process is
started in a tmux session named after the run (fallback: ``setsid``) through a
small ``sh`` wrapper that records its PID before the command starts and the
command's exit status when it ends, so a later call, or a later program, can
tell a natural exit from a vanished process. Identity of a process is
(PID, start time in clock ticks since boot, command line): only a process that
matches all three may be signalled.

GPU inventory comes from ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``
and ``--query-compute-apps=...``; its absence is reported as ``no_gpu``, never as
success. A server that must have a GPU (:attr:`ServerConfig.gpu_expected`: SSH by default)
fails preflight and refuses launches when nvidia-smi is missing, fails or lists none.

Modules: :mod:`~dpflow_core.server.config` (how to reach the server), :mod:`~dpflow_core.server.transports`
(SSH and local), :mod:`~dpflow_core.server.procfs` (/proc parsing), :mod:`~dpflow_core.server.tmux`
(detached processes), :mod:`~dpflow_core.server.nvidia_smi` (GPU inventory),
:mod:`~dpflow_core.server.gpu_server` (:class:`GpuServer`, the one interface),
:mod:`~dpflow_core.server.preflight` (is the server ready?) and :mod:`~dpflow_core.server.upload`
(dataset upload, verified by SHA-256), with :mod:`~dpflow_core.server.paths` (where a dataset lives
there), and :mod:`~dpflow_core.server.lab` (a lab.yaml's ``server:`` section: one server, a Slurm
cluster with :class:`SlurmSettings`, or several hosts). The server API is re-exported here.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports
from dpflow_core.files import sha256_file

# Names are imported from their module on first use (PEP 562): importing one submodule, or this
# package, does not load the others and their dependencies.
__getattr__, __dir__ = lazy_exports(__name__, {
    'CommandResult': 'config',
    'PROJECT_ROOT': 'config',
    'ServerConfig': 'config',
    'SlurmSettings': 'config',
    'default_local_data_root': 'config',
    'default_local_repo': 'config',
    'is_sha256': 'config',
    'GpuServer': 'gpu_server',
    'GPU_APPS_QUERY_ARGS': 'nvidia_smi',
    'GPU_QUERY_ARGS': 'nvidia_smi',
    'GpuInfo': 'nvidia_smi',
    'GpuInventory': 'nvidia_smi',
    'GpuProcess': 'nvidia_smi',
    'gpu_problem': 'nvidia_smi',
    'parse_compute_apps': 'nvidia_smi',
    'parse_gpu_query': 'nvidia_smi',
    'ProcessInfo': 'procfs',
    'DetachedProcess': 'tmux',
    'DetachedStatus': 'tmux',
    'FileChunk': 'transports',
})

__all__ = [
    "GPU_APPS_QUERY_ARGS", "GPU_QUERY_ARGS", "PROJECT_ROOT", "CommandResult", "DetachedProcess",
    "DetachedStatus", "FileChunk", "GpuInfo", "GpuInventory", "GpuProcess", "GpuServer", "ProcessInfo",
    "ServerConfig", "SlurmSettings", "default_local_data_root", "default_local_repo", "gpu_problem", "is_sha256", "parse_compute_apps",
    "parse_gpu_query", "sha256_file",
]
