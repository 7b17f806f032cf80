"""A stand-in for upstream Diffusion Policy / UMI's ``train.py`` (tests only; our own code).

Labs train with their own checkout of the Diffusion Policy / UMI repository:
``python train.py --config-name=<workspace config> key=value ...``. This script takes
the same command line and writes what such a trainer leaves in its Hydra run directory,
so dpflow's checks can be tested against that format without the upstream code:

* ``.hydra/config.yaml``: the resolved config (``training.num_epochs``, ``max_train_steps``, ...);
* ``logs.json.txt``: one JSON object per batch (``train_loss``, ``global_step``, ``epoch``,
  ``lr``); the epoch's last batch line also carries the epoch's mean ``train_loss``;
  no dpflow-specific fields;
* ``checkpoints/latest.ckpt`` and top-k files ``epoch=0003-train_loss=0.012.ckpt``, in the
  workspace format ``{'cfg', 'state_dicts': {'model', 'ema_model', 'optimizer'}, 'pickles':
  {'global_step', 'epoch', '_output_dir'}}`` (each pickle a ``dill.dumps`` bytes object),
  saved with ``torch.save(payload, f, pickle_module=dill)`` to a temporary name, then renamed.

Test-only overrides: ``standin.drop=optimizer,ema_model`` leaves those state dicts out of
every checkpoint (an incomplete checkpoint); ``standin.step_s`` sleeps per batch.

Run it as a script (the train command), or import :func:`save_workspace_checkpoint`.
"""

from __future__ import annotations

import json
import os
import sys
import time


def save_workspace_checkpoint(path: str, *, cfg: dict, epoch: int, global_step: int, output_dir: str,
                              drop: tuple[str, ...] = ()) -> None:
    """Write an upstream-style workspace checkpoint to ``path`` (temporary name, then rename).

    The model is a 4 -> 2 ``torch.nn.Linear``; ``ema_model`` a copy; ``optimizer`` the
    AdamW state after one step. ``cfg`` is stored as an OmegaConf ``DictConfig``, as
    upstream does, so ``torch.load(weights_only=True)`` refuses the file and a full load
    (with dill) is needed.
    """
    import copy

    import dill
    import torch
    from omegaconf import OmegaConf

    torch.manual_seed(global_step)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).pow(2).mean().backward()
    optimizer.step()
    state_dicts = {
        "model": model.state_dict(),
        "ema_model": copy.deepcopy(model).state_dict(),
        "optimizer": optimizer.state_dict(),
    }
    payload = {
        "cfg": OmegaConf.create(cfg),
        "state_dicts": {k: v for k, v in state_dicts.items() if k not in drop},
        "pickles": {"global_step": dill.dumps(global_step), "epoch": dill.dumps(epoch), "_output_dir": dill.dumps(output_dir)},
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save(payload, fh, pickle_module=dill)
    os.replace(tmp, path)


def _overrides(argv: list[str]) -> tuple[str | None, dict[str, str]]:
    config_name = None
    values = {}
    for arg in argv:
        if arg.startswith("--config-name="):
            config_name = arg.split("=", 1)[1]
        elif "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            values[key.lstrip("+")] = value
    return config_name, values


def main(argv: list[str]) -> int:
    config_name, args = _overrides(argv)
    if not config_name:
        print("train.py: --config-name is required", file=sys.stderr)
        return 2
    run_dir = args["hydra.run.dir"]
    epochs = int(args.get("training.num_epochs", "2"))
    steps = int(args.get("training.max_train_steps", "3"))
    save_last = args.get("checkpoint.save_last_ckpt", "true") != "false"
    topk = int(args.get("checkpoint.topk.k", "2"))
    drop = tuple(d for d in args.get("standin.drop", "").split(",") if d)
    step_s = float(args.get("standin.step_s", "0"))
    cfg = {
        "name": config_name,
        "task": {"dataset_path": args.get("task.dataset_path"), "dataset_frequeny": float(args.get("task.dataset_frequeny", "0"))},
        "training": {"num_epochs": epochs, "max_train_steps": steps, "seed": int(args.get("training.seed", "42")),
                     "resume": args.get("training.resume", "false") == "true"},
        "dataloader": {"batch_size": int(args.get("dataloader.batch_size", "8"))},
        "logging": {"mode": args.get("logging.mode", "online"), "name": args.get("logging.name", "")},
        "checkpoint": {"save_last_ckpt": save_last, "topk": {"k": topk, "monitor_key": "train_loss", "mode": "min",
                                                             "format_str": "epoch={epoch:04d}-train_loss={train_loss:.3f}.ckpt"}},
    }
    os.makedirs(os.path.join(run_dir, ".hydra"), exist_ok=True)
    import yaml

    with open(os.path.join(run_dir, ".hydra", "config.yaml"), "w") as fh:
        yaml.safe_dump(cfg, fh)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    topk_files: list[tuple[float, str]] = []
    global_step = 0
    with open(os.path.join(run_dir, "logs.json.txt"), "a") as log:
        for epoch in range(epochs):
            losses = []
            for batch in range(steps):
                loss = 1.0 / (global_step + 1)
                losses.append(loss)
                record = {"train_loss": loss, "global_step": global_step, "epoch": epoch, "lr": 1e-3}
                if batch == steps - 1:  # upstream logs the epoch's mean train_loss on its last batch
                    record["train_loss"] = sum(losses) / len(losses)
                log.write(json.dumps(record) + "\n")
                log.flush()
                global_step += 1
                time.sleep(step_s)
            epoch_loss = sum(losses) / len(losses)
            if save_last or topk:
                os.makedirs(ckpt_dir, exist_ok=True)
            common = dict(cfg=cfg, epoch=epoch, global_step=global_step, output_dir=run_dir, drop=drop)
            if topk:
                name = cfg["checkpoint"]["topk"]["format_str"].format(epoch=epoch, train_loss=epoch_loss)
                topk_files.append((epoch_loss, name))
                topk_files.sort()
                save_workspace_checkpoint(os.path.join(ckpt_dir, name), **common)
                for _, old in topk_files[topk:]:
                    os.remove(os.path.join(ckpt_dir, old))
                del topk_files[topk:]
            if save_last:
                save_workspace_checkpoint(os.path.join(ckpt_dir, "latest.ckpt"), **common)
    print(f"train.py ({config_name}): {epochs} epochs done, global_step {global_step - 1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
