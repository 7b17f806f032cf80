"""A fake ``nvidia-smi`` for machines without a GPU (tests only).

``write_fake_nvidia_smi(folder, gpus, apps, mode=...)`` writes an executable script that
answers the two queries dpflow makes exactly as the real tool does with
``--format=csv,noheader,nounits``: one line per GPU / compute process, fields
separated by ``", "``, memory in MiB without units, ``[N/A]`` where a value is
not available. The failure modes reproduce the real tool's messages and exit
statuses (NVIDIA's nvidia-smi manual page, "RETURN VALUE"; the tool prints these
messages on stdout, not stderr):

* ``mode="driver"`` (or ``fail=True``): the driver is not loaded: "NVIDIA-SMI has
  failed because it couldn't communicate with the NVIDIA driver. Make sure that
  the latest NVIDIA driver is installed and running.", exit status 9;
* ``mode="no_devices"``: a driver that sees no GPU: "No devices were found", exit status 6;
* ``mode="empty"``: the query answers with no line at all, exit status 0.

An absent nvidia-smi is a path where nothing was written (the shell answers 127).

Import it from a test module as ``from fake_nvidia_smi import write_fake_nvidia_smi``.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Two H200s as ``index, uuid, name, memory.total, memory.used, utilization.gpu``.
H200_GPUS = (
    "0, GPU-5b8a8f2c-1d3e-4c7e-9a8b-0f1e2d3c4b5a, NVIDIA H200, 143771, 20905, 87",
    "1, GPU-0c2e9d4b-7a61-4f0e-8d2b-3e4f5a6b7c8d, NVIDIA H200, 143771, 1, 0",
)
#: One process on GPU 0 as ``pid, gpu_uuid, used_memory, process_name``.
H200_APPS = ("48213, GPU-5b8a8f2c-1d3e-4c7e-9a8b-0f1e2d3c4b5a, 20480, /opt/conda/envs/dp/bin/python",)

DRIVER_FAILURE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
DRIVER_FAILURE_EXIT = 9
NO_DEVICES = "No devices were found"
NO_DEVICES_EXIT = 6
MODES = ("ok", "driver", "no_devices", "empty")


def write_fake_nvidia_smi(
    folder: Path, gpus=H200_GPUS, apps=H200_APPS, *, fail: bool = False, mode: str = "ok"
) -> Path:
    """Write ``folder/nvidia-smi`` and return its path (``mode``: one of :data:`MODES`)."""
    mode = "driver" if fail else mode
    if mode not in MODES:
        raise ValueError(f"unknown fake nvidia-smi mode {mode!r}; known: {MODES}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpus.csv").write_text("" if mode == "empty" else "".join(line + "\n" for line in gpus))
    (folder / "apps.csv").write_text("".join(line + "\n" for line in apps))
    script = folder / "nvidia-smi"
    if mode == "driver":
        body = f'echo "{DRIVER_FAILURE}"\nexit {DRIVER_FAILURE_EXIT}\n'
    elif mode == "no_devices":
        body = f'echo "{NO_DEVICES}"\nexit {NO_DEVICES_EXIT}\n'
    else:
        body = (
            'case "$*" in\n'
            f'  *--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu*--format=csv,noheader,nounits*) cat "{folder}/gpus.csv" ;;\n'
            f'  *--query-compute-apps=pid,gpu_uuid,used_memory,process_name*--format=csv,noheader,nounits*) cat "{folder}/apps.csv" ;;\n'
            '  *) echo "fake nvidia-smi: unsupported arguments: $*" >&2; exit 2 ;;\n'
            "esac\n"
        )
    script.write_text("#!/bin/sh\n" + body)
    os.chmod(script, 0o755)
    return script
