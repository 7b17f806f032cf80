"""A fake ``nvidia-smi`` for machines without a GPU (tests only).

``write_fake_nvidia_smi(folder, gpus, apps)`` writes an executable script that
answers the two queries dpflow makes exactly as the real tool does with
``--format=csv,noheader,nounits``: one line per GPU / compute process, fields
separated by ``", "``, memory in MiB without units, ``[N/A]`` where a value is
not available. ``fail=True`` imitates a machine whose driver is not loaded
(message on stdout, exit status 9, as nvidia-smi does).

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

_DRIVER_FAILURE = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


def write_fake_nvidia_smi(folder: Path, gpus=H200_GPUS, apps=H200_APPS, *, fail: bool = False) -> Path:
    """Write ``folder/nvidia-smi`` and return its path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpus.csv").write_text("".join(line + "\n" for line in gpus))
    (folder / "apps.csv").write_text("".join(line + "\n" for line in apps))
    script = folder / "nvidia-smi"
    if fail:
        body = f'echo "{_DRIVER_FAILURE}"\nexit 9\n'
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
