"""``python -m dpflow_core.train`` / ``dpflow-train``: the trainer's Hydra command line.

Accepts the overrides of the Diffusion Policy / UMI ``train.py`` family::

    python -m dpflow_core.train --config-name=tiny task.dataset_path=data/dataset.npz \\
        task.dataset_frequeny=29.97 logging.mode=offline training.num_epochs=10 \\
        training.max_train_steps=50 dataloader.batch_size=32 dataloader.num_workers=4 \\
        checkpoint.topk.k=3 hydra.run.dir=runs/my_run

    accelerate launch --num_processes 2 -m dpflow_core.train ...   # the same, on 2 processes

Config groups: task, training, dataloader, val_dataloader, checkpoint,
logging, optimizer, ema (files under ``conf/``); ``--config-name`` picks
``train_diffusion_unet_image`` (default: 224x224, To=2, horizon 16, ResNet-18-GN),
``train_diffusion_unet_timm_umi`` (UMI's ViT-B/16 CLIP workspace), ``demo``
(the 2-core demo) or ``tiny`` (CPU tests). The composed config is in struct mode: an unknown or
misspelled key fails before any work, and adding (``+key``) or deleting
(``~key``) trainer keys is refused as well. A :class:`~dpflow_core.errors.DpflowError`
ends the process with one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from dpflow_core.errors import DpflowError

#: The packaged configs (an absolute path: Hydra then reads files, both from a
#: checkout and from an installed wheel, however the module was started).
CONFIG_DIR = Path(__file__).resolve().parent / "conf"
DEFAULT_CONFIG_NAME = "train_diffusion_unet_image"
CONFIG_NAMES = (DEFAULT_CONFIG_NAME, "train_diffusion_unet_timm_umi", "demo", "sim", "tiny")


def _process_rank() -> int:
    """Global rank set by ``accelerate launch`` / torchrun (0 when run alone)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def refused_overrides(args: list[str]) -> list[str]:
    """Command-line overrides that would add or delete trainer keys (``+key=...``, ``~key``).

    Hydra's own keys (``+hydra...``) stay allowed.
    """
    bad = []
    for arg in args:
        if arg.startswith(("+", "~")) and not arg.lstrip("+~").startswith("hydra"):
            bad.append(arg)
    return bad


@hydra.main(config_path=str(CONFIG_DIR), config_name=DEFAULT_CONFIG_NAME)
def _hydra_main(cfg: DictConfig) -> None:
    from dpflow_core.train.workspace import train

    try:
        train(cfg, HydraConfig.get().runtime.output_dir)
    except DpflowError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def main() -> None:
    """Console-script entry point (``dpflow-train``)."""
    args = sys.argv[1:]
    bad = refused_overrides(args)
    if bad:
        print(
            f"error: {' '.join(bad)}: adding or deleting trainer config keys is not allowed; "
            "override existing keys only (see --cfg job for the full config)",
            file=sys.stderr,
        )
        sys.exit(2)
    if _process_rank() != 0:
        # Only the main process writes .hydra/ and the job log in the run directory.
        sys.argv.append("hydra.output_subdir=null")
        if not any(a.startswith("hydra/job_logging") for a in args):
            sys.argv.append("hydra/job_logging=stdout")
    _hydra_main()
