"""The launch command: ``accelerate launch`` arguments and the rendered train command.

Takes a :class:`~dpflow_core.runs.spec.RunSpec`, the run directory and the chosen GPU ids; gives the
shell command line (a string), the argument list and the number of processes.
"""

from __future__ import annotations

import hashlib
import posixpath
import shlex
import string
from dataclasses import dataclass
from typing import Sequence

from dpflow_core.errors import RunError
from dpflow_core.server import GpuServer
from dpflow_core.runs.spec import TEMPLATE_FIELDS, RunSpec


# ------------------------------------------------------------------------- command


def default_main_process_port(name: str) -> int:
    """A rendezvous port derived from the run name (29500-30499), so parallel runs do not collide."""
    return 29500 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % 1000


@dataclass(frozen=True)
class MachineRank:
    """This machine's place in a multi-machine launch (accelerate's ``--num_machines`` family).

    Attributes:
        rank: ``--machine_rank`` (0 is the main machine, which hosts the rendezvous).
        count: ``--num_machines``.
        main_address: ``--main_process_ip``, the main machine's address as the others reach it.
        port: ``--main_process_port`` on the main machine.
    """

    rank: int
    count: int
    main_address: str
    port: int

    def to_dict(self) -> dict:
        return {"rank": self.rank, "count": self.count, "main_address": self.main_address, "port": self.port}


def launcher_args(num_processes: int, gpu_ids: Sequence[int], run_name: str, machine: MachineRank | None = None) -> list[str]:
    """``accelerate launch`` options for N processes on the given GPUs (CPU: one process).

    With ``machine``, the options of one machine of a multi-machine run: ``--num_processes`` is the
    total over all machines (processes per machine x machines), ``--multi_gpu`` always (CPU
    processes then use gloo, with ``ACCELERATE_USE_CPU`` set by the launch).
    """
    if machine is not None:
        total = max(1, len(gpu_ids)) * int(machine.count)
        args = ["--multi_gpu", "--num_processes", str(total), "--num_machines", str(int(machine.count)),
                "--machine_rank", str(int(machine.rank)), "--main_process_ip", machine.main_address,
                "--main_process_port", str(int(machine.port)), "--mixed_precision", "no", "--dynamo_backend", "no"]
        if gpu_ids:
            args += ["--gpu_ids", ",".join(str(int(g)) for g in gpu_ids)]
        return args
    if not gpu_ids:
        return ["--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    args = ["--num_processes", str(int(num_processes)), "--gpu_ids", ",".join(str(int(g)) for g in gpu_ids),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if int(num_processes) > 1:
        args += ["--multi_gpu", "--main_process_port", str(default_main_process_port(run_name))]
    return args


def render_train_command(
    template: str,
    *,
    run_dir: str,
    dataset: str,
    overrides: Sequence[str],
    num_processes: int,
    gpu_ids: Sequence[int],
    config_name: str,
) -> str:
    """Fill a train command template; the result is a shell fragment.

    Placeholders: ``{run_dir}``, ``{dataset}``, ``{overrides}`` (all overrides, each
    shell-quoted), ``{num_processes}``, ``{gpu_ids}`` (comma-separated, empty on CPU),
    ``{config_name}``. Values are shell-quoted. When the template does not place
    ``{overrides}`` they are appended. Literal braces are written ``{{`` and ``}}``.

    Raises:
        RunError: for an unknown placeholder or a malformed template.
    """
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    unknown = sorted({f for f in fields if f not in TEMPLATE_FIELDS})
    if unknown:
        raise RunError(
            f"unknown placeholder(s) {unknown} in train command {template!r}; allowed: {list(TEMPLATE_FIELDS)}",
            code="bad_template",
        )
    quoted = " ".join(shlex.quote(o) for o in overrides)
    values = {
        "run_dir": shlex.quote(run_dir),
        "dataset": shlex.quote(dataset),
        "overrides": quoted,
        "num_processes": str(int(num_processes)),
        "gpu_ids": shlex.quote(",".join(str(g) for g in gpu_ids)) if gpu_ids else "''",
        "config_name": shlex.quote(config_name),
    }
    try:
        text = template.format(**values)
    except (ValueError, IndexError, KeyError) as exc:
        raise RunError(f"malformed train command template {template!r}: {exc}", code="bad_template") from exc
    if "overrides" not in fields and quoted:
        text = f"{text} {quoted}"
    return text


def is_full_command(template: str) -> bool:
    """True when the template launches by itself (its first word is ``accelerate``)."""
    words = template.split()
    return bool(words) and posixpath.basename(words[0]) == "accelerate"


def build_command(
    server: GpuServer, spec: RunSpec, run_dir: str, gpu_ids: Sequence[int], machine: MachineRank | None = None,
) -> tuple[str, list[str], int]:
    """The shell command of a run, its overrides, and the process count.

    ``<activate> && <python> -m accelerate.commands.launch <launcher_args> <train command>``;
    a template starting with ``accelerate`` is the whole command (its placeholders give
    the process count and GPU ids). ``machine`` makes it one machine of a multi-machine run;
    the returned count is this machine's processes.
    """
    num_processes = len(gpu_ids) if gpu_ids else 1
    overrides = spec.overrides(run_dir)
    train = render_train_command(
        spec.train_command, run_dir=run_dir, dataset=spec.dataset_path, overrides=overrides,
        num_processes=num_processes, gpu_ids=gpu_ids, config_name=spec.config_name,
    )
    if is_full_command(spec.train_command):
        line = train
    else:
        python = " ".join(shlex.quote(w) for w in shlex.split(server.config.python))
        launch = " ".join(shlex.quote(a) for a in ["-m", "accelerate.commands.launch", *launcher_args(num_processes, gpu_ids, spec.name, machine)])
        line = f"{python} {launch} {train}"
    if server.config.activate:
        line = f"{server.config.activate} && {line}"
    return line, overrides, num_processes
