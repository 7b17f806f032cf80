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

It really trains: a ``torch.nn.Linear(4, 2)`` regression on a fixed synthetic data set
(seeded by ``training.seed``), AdamW (``optimizer.lr``, default 0.05) under a cosine
schedule with linear warm-up (``training.lr_warmup_steps``, default 2) stepped per batch,
and an EMA copy (decay 0.9). With ``training.resume=true`` it loads
``<hydra.run.dir>/checkpoints/latest.ckpt`` when present (as upstream does) and continues:
model, EMA and optimizer state from ``state_dicts``, ``global_step`` and ``epoch`` from
``pickles``, the schedule rebuilt at ``last_epoch=global_step - 1`` (upstream's way).
``training.num_epochs`` counts all epochs, resumed ones included. Each batch is drawn
from a generator seeded with (seed, global_step), so a resumed run sees the batches the
uninterrupted one saw without RNG state in the checkpoint (upstream keeps none).
Checkpoint ``pickles``: ``epoch`` is the last finished epoch, ``global_step`` the batches done.

As UMI's workspace, a run with ``training.resume=false`` leaves the optimizer state out of its
checkpoints (such a checkpoint cannot resume); dpflow therefore passes ``training.resume=true``
to every upstream-style run (it resumes only when the run directory already has ``latest.ckpt``).

Test-only overrides: ``standin.drop=optimizer,ema_model`` leaves those state dicts out of
every checkpoint (an incomplete checkpoint); ``standin.restore=model,ema_model`` loads only
those on resume (a restore that loses the optimizer state); ``standin.reset_global_step=true``
resumes from global_step 0 (a restore that loses the step); ``standin.step_s`` sleeps per batch.

Run it as a script (the train command), or import :func:`save_workspace_checkpoint`.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import time

STATE_DICTS = ("model", "ema_model", "optimizer")
EMA_DECAY = 0.9


def save_workspace_checkpoint(path: str, *, cfg: dict, epoch: int, global_step: int, output_dir: str,
                              state_dicts: dict | None = None, drop: tuple[str, ...] = ()) -> None:
    """Write an upstream-style workspace checkpoint to ``path`` (temporary name, then rename).

    ``state_dicts`` maps ``model``, ``ema_model``, ``optimizer`` to state dicts; when None,
    a 4 -> 2 ``torch.nn.Linear``, its copy and the AdamW state after one step stand in.
    ``drop`` names state dicts left out. ``cfg`` is stored as an OmegaConf ``DictConfig``,
    as upstream does, so ``torch.load(weights_only=True)`` refuses the file and a full load
    (with dill) is needed.
    """
    import dill
    import torch
    from omegaconf import OmegaConf

    if state_dicts is None:
        torch.manual_seed(global_step)
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(3, 4)).pow(2).mean().backward()
        optimizer.step()
        state_dicts = {"model": model.state_dict(), "ema_model": copy.deepcopy(model).state_dict(),
                       "optimizer": optimizer.state_dict()}
    payload = {
        "cfg": OmegaConf.create(cfg),
        "state_dicts": {k: v for k, v in state_dicts.items() if k not in drop},
        "pickles": {"global_step": dill.dumps(global_step), "epoch": dill.dumps(epoch), "_output_dir": dill.dumps(output_dir)},
    }
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as fh:
        torch.save(payload, fh, pickle_module=dill)
    os.replace(tmp, path)


def _cosine_with_warmup(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return factor


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
    if args.get("training.resume", "false") != "true":
        drop += ("optimizer",)  # UMI's workspace keeps the optimizer out of its checkpoints unless resume is on
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
    import dill
    import torch

    seed = cfg["training"]["seed"]
    data = torch.Generator().manual_seed(seed)
    inputs = torch.randn(64, 4, generator=data)
    targets = inputs @ torch.randn(4, 2, generator=data) + 0.1 * torch.randn(64, 2, generator=data)
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    ema_model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(args.get("optimizer.lr", "0.05")), weight_decay=1e-6)
    global_step, first_epoch = 0, 0
    latest = os.path.join(ckpt_dir, "latest.ckpt")
    if cfg["training"]["resume"] and os.path.isfile(latest):
        print(f"Resuming from checkpoint {latest}", flush=True)
        with open(latest, "rb") as fh:
            payload = torch.load(fh, map_location="cpu", pickle_module=dill, weights_only=False)
        restore = [r for r in args.get("standin.restore", ",".join(STATE_DICTS)).split(",") if r]
        for key, target in (("model", model), ("ema_model", ema_model), ("optimizer", optimizer)):
            if key in restore:
                target.load_state_dict(payload["state_dicts"][key])
        global_step = dill.loads(payload["pickles"]["global_step"])
        first_epoch = dill.loads(payload["pickles"]["epoch"]) + 1
        if args.get("standin.reset_global_step") == "true":
            global_step = 0
    for group in optimizer.param_groups:  # what a fresh scheduler records; a restored optimizer has it
        group.setdefault("initial_lr", group["lr"])
    warmup = int(args.get("training.lr_warmup_steps", "2"))
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _cosine_with_warmup(warmup, epochs * steps), last_epoch=global_step - 1)
    batch_size = cfg["dataloader"]["batch_size"]
    topk_files: list[tuple[float, str]] = []
    with open(os.path.join(run_dir, "logs.json.txt"), "a") as log:
        for epoch in range(first_epoch, epochs):
            losses = []
            for batch in range(steps):
                index = torch.randint(0, len(inputs), (batch_size,), generator=torch.Generator().manual_seed(seed * 100003 + global_step))
                loss = torch.nn.functional.mse_loss(model(inputs[index]), targets[index])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                lr_scheduler.step()
                with torch.no_grad():
                    for p_ema, p in zip(ema_model.parameters(), model.parameters()):
                        p_ema.lerp_(p, 1.0 - EMA_DECAY)
                losses.append(loss.item())
                record = {"train_loss": loss.item(), "global_step": global_step, "epoch": epoch,
                          "lr": lr_scheduler.get_last_lr()[0]}
                if batch == steps - 1:  # upstream logs the epoch's mean train_loss on its last batch
                    record["train_loss"] = sum(losses) / len(losses)
                log.write(json.dumps(record) + "\n")
                log.flush()
                global_step += 1
                time.sleep(step_s)
            epoch_loss = sum(losses) / len(losses)
            if save_last or topk:
                os.makedirs(ckpt_dir, exist_ok=True)
            state_dicts = {"model": model.state_dict(), "ema_model": ema_model.state_dict(), "optimizer": optimizer.state_dict()}
            common = dict(cfg=cfg, epoch=epoch, global_step=global_step, output_dir=run_dir, state_dicts=state_dicts, drop=drop)
            if topk:
                name = cfg["checkpoint"]["topk"]["format_str"].format(epoch=epoch, train_loss=epoch_loss)
                topk_files.append((epoch_loss, name))
                topk_files.sort()
                save_workspace_checkpoint(os.path.join(ckpt_dir, name), **common)
                for _, old in topk_files[topk:]:
                    os.remove(os.path.join(ckpt_dir, old))
                del topk_files[topk:]
            if save_last:
                save_workspace_checkpoint(latest, **common)
    print(f"train.py ({config_name}): {epochs} epochs done, global_step {global_step - 1}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
