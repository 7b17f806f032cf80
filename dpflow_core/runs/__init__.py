"""Runs on the GPU server: identity, launch, monitoring, and the checks of rules 1 and 5-12.

Run identity (rule 1). A run has one validated name (:func:`dpflow_core.names.validate_name`);
everything else derives from it:

    <data_root>/runs/<name>/                 run directory = Hydra output dir (``hydra.run.dir``)
    <data_root>/runs/<name>/wandb/           W&B files (``WANDB_DIR`` = the run directory)
    <data_root>/runs/<name>/dpflow/launch-<k>/   dpflow's state of launch k: wrapper, PID,
                                             exit status, process output, launch record
    tmux session                             ``<name>`` (``.`` -> ``_``)

A new run refuses an existing directory (the directory is created with a
plain ``mkdir``, which fails when it exists, so two launches cannot both own
it); resume is an explicit choice that first verifies ``latest.ckpt`` is
complete. GPU ids come from the current ``nvidia-smi`` (GPUs without compute
processes), never from an earlier run; the dataset frequency from the
dataset's metadata.

Command. ``accelerate launch --num_processes N --gpu_ids ... --num_machines 1
--dynamo_backend no <train command> <overrides>`` run through the server's
configured Python (``python -m accelerate.commands.launch``, so the launcher is
the one of the training environment). The train command is a template
(:data:`DEFAULT_TRAIN_COMMAND`, the built-in trainer, by default); see
:func:`render_train_command`. Without a GPU the same launcher runs one CPU
process (``--cpu --num_processes 1``): one code path on every machine.

Which processes are the run's. The launch exports a random token
(``DPFLOW_RUN_TOKEN``) that every descendant inherits; a process is this
run's when its ``/proc/<pid>/environ`` holds that exact token, or when it is
in the run's process group or session while the group leader (the wrapper
recorded at launch, identified by PID, start time and command line) is still
alive. Process groups alone are not enough: torch's elastic launcher starts
every multi-GPU worker in a session of its own. A command line that merely
mentions ``train.py`` proves nothing and is never used. Cleanup sends TERM to
each proven process (identity re-read just before the signal), waits, and
sends KILL only to those still alive and still proven; never a broad pkill.

Modules, in the order of a run's life: :mod:`~dpflow_core.runs.spec` (spec and naming),
:mod:`~dpflow_core.runs.gpus` (GPU choice), :mod:`~dpflow_core.runs.command` (launch command),
:mod:`~dpflow_core.runs.state` (launch state), :mod:`~dpflow_core.runs.records` (checkpoint probe,
records), :mod:`~dpflow_core.runs.launch`, :mod:`~dpflow_core.runs.processes` (ownership, cleanup),
:mod:`~dpflow_core.runs.release`, :mod:`~dpflow_core.runs.oom` (OOM advice),
:mod:`~dpflow_core.runs.monitor`, :mod:`~dpflow_core.runs.smoke`, :mod:`~dpflow_core.runs.settings` (what a
person chooses about a run, declared once), :mod:`~dpflow_core.runs.recipe` (the one smoke and training recipe), :mod:`~dpflow_core.runs.natural_exit`
and :mod:`~dpflow_core.runs.continuity` (resume continuity). Beyond one server:
:mod:`~dpflow_core.runs.slurm` (sbatch, squeue/sacct, scancel by job id) with
:mod:`~dpflow_core.runs.slurm_checks` (natural exit, release, smoke, preflight on a cluster), and
:mod:`~dpflow_core.runs.multihost` (one run over several servers, accelerate's multi-machine launch).
The names other code uses are re-exported here.
"""

from __future__ import annotations

from dpflow_core._lazy import lazy_exports

# each name is imported from its module on first use: `from dpflow_core.runs.settings import ...` (the command
# line's options) does not load the launch, monitor and server modules
__getattr__, __dir__ = lazy_exports(__name__, {
    "CHECKPOINT_DIR": "spec",
    "CPU_CONFIG_NAME": "spec",
    "CPU_RUN_NOTE": "spec",
    "CheckpointProbe": "records",
    "CleanupReport": "processes",
    "ContinuityReport": "continuity",
    "DEFAULT_TRAIN_COMMAND": "spec",
    "FREE_GPU_MAX_USED_MIB": "gpus",
    "GPU_CONFIG_NAME": "spec",
    "GPU_RELEASE_TOLERANCE_MIB": "release",
    "HANDLE_NAME": "spec",
    "JsonLinesFollower": "messages",
    "LATEST_CKPT": "spec",
    "LOG_NAME": "spec",
    "MonitorResult": "monitor",
    "NaturalExitReport": "natural_exit",
    "OUTPUT_LOG": "spec",
    "ProgressCallback": "monitor",
    "RECORD_NAME": "spec",
    "RELEASE_NAME": "spec",
    "RUNS_DIR": "spec",
    "ReleaseReport": "release",
    "ReportedCheck": "monitor",
    "ResumeCheckSize": "smoke",
    "RunHandle": "state",
    "RunSpec": "spec",
    "STATE_DIR": "spec",
    "SmokeResult": "smoke",
    "SmokeRun": "smoke",
    "SmokeSettings": "settings",
    "TEMPLATE_FIELDS": "spec",
    "TOKEN_ENV": "spec",
    "TRAIN_COMMAND_PRESETS": "spec",
    "TrainResult": "monitor",
    "TrainSettings": "settings",
    "UPSTREAM_TRAIN_COMMAND": "spec",
    "active_or_new_run_name": "state",
    "attachable_handle": "launch",
    "build_command": "command",
    "check_natural_exit": "natural_exit",
    "check_released": "release",
    "check_resume_continuity": "continuity",
    "choose_gpus": "gpus",
    "cleanup_run": "processes",
    "compare_logs": "continuity",
    "dataset_frequency": "spec",
    "default_run_name": "spec",
    "describe_exit": "monitor",
    "describe_process": "processes",
    "finalize_record": "records",
    "find_active_runs": "state",
    "free_gpus": "gpus",
    "gpu_memory": "gpus",
    "hydra_value": "spec",
    "is_builtin_trainer": "spec",
    "is_full_command": "command",
    "is_out_of_memory": "oom",
    "launch_indices": "state",
    "launch_or_attach": "launch",
    "launch_run": "launch",
    "launcher_args": "command",
    "list_checkpoints": "smoke",
    "load_handle": "state",
    "load_release_report": "release",
    "monitor_run": "monitor",
    "oom_advice": "oom",
    "probe_checkpoint": "records",
    "read_run_config": "natural_exit",
    "render_train_command": "command",
    "reproducibility_record": "records",
    "require_gpus": "gpus",
    "resolve_config_name": "spec",
    "run_dir_for": "spec",
    "run_disk_usage": "state",
    "run_processes": "processes",
    "run_smoke": "smoke",
    "runs_root": "spec",
    "save_release_report": "release",
    "smoke_spec": "recipe",
    "token_pids": "processes",
    "utc_now": "spec",
})

__all__ = [
    "CHECKPOINT_DIR", "CPU_CONFIG_NAME", "CPU_RUN_NOTE", "DEFAULT_TRAIN_COMMAND", "FREE_GPU_MAX_USED_MIB", "GPU_CONFIG_NAME",
    "GPU_RELEASE_TOLERANCE_MIB", "active_or_new_run_name", "HANDLE_NAME", "LATEST_CKPT", "LOG_NAME", "OUTPUT_LOG", "RECORD_NAME",
    "RELEASE_NAME", "RUNS_DIR", "STATE_DIR", "TEMPLATE_FIELDS", "TOKEN_ENV", "TRAIN_COMMAND_PRESETS", "UPSTREAM_TRAIN_COMMAND", "CheckpointProbe", "CleanupReport",
    "ContinuityReport", "MonitorResult", "NaturalExitReport", "ProgressCallback", "ReleaseReport", "RunHandle",
    "RunSpec", "SmokeResult", "SmokeSettings", "TrainSettings", "SmokeRun", "ResumeCheckSize", "TrainResult", "ReportedCheck", "build_command", "check_natural_exit", "check_released", "check_resume_continuity",
    "choose_gpus", "cleanup_run", "compare_logs", "dataset_frequency", "default_run_name", "describe_exit",
    "describe_process", "finalize_record", "find_active_runs", "free_gpus", "gpu_memory", "hydra_value",
    "JsonLinesFollower", "attachable_handle", "is_builtin_trainer", "is_full_command", "is_out_of_memory", "launch_indices", "launch_or_attach", "launch_run", "launcher_args",
    "list_checkpoints", "load_handle", "load_release_report", "monitor_run", "oom_advice", "probe_checkpoint",
    "read_run_config", "render_train_command", "reproducibility_record", "require_gpus", "resolve_config_name", "run_dir_for",
    "run_disk_usage", "run_processes", "run_smoke", "runs_root", "save_release_report", "smoke_spec", "token_pids",
    "utc_now",
]
