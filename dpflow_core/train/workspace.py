"""The training loop of the built-in Diffusion Policy trainer.

:func:`train` owns a run's lifecycle: it opens the dataset, builds the policy,
its EMA, the optimizer and the learning-rate schedule, restores all of them
(plus RNG and data-order state) on resume, runs the epochs, validates, logs
and saves checkpoints. It runs alone (``python -m dpflow_core.train``) or under
``accelerate launch --num_processes N``: every process trains on its own
shard of each batch order and takes part in every collective (gradient
all-reduce, metric reduction, gathering RNG states for a checkpoint); only the
main process writes files and talks to W&B, and all processes wait for it
after each save.

Resume is exact: a run interrupted after a checkpoint and resumed with
``training.resume=true`` produces the same losses, learning rates and weights
as one that ran straight through (bit for bit on the CPU, same process count).

This module is over 500 lines because the training loop, the checkpoint state it saves and the
exact-resume guarantee above can only be checked by reading them together.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader

from dpflow_core.errors import DatasetError, RunError
from dpflow_core.replay_buffer import ReplayBuffer
from dpflow_core.train import checkpoint as ckpt
from dpflow_core.train.config import (
    apply_threads,
    bf16_reason,
    check_config,
    mixed_precision_of,
    obs_encoder_lr_scale,
    spec_from_config,
    throughput_settings,
)
from dpflow_core.train.batches import SequenceDataset, pass_batch
from dpflow_core.train.data import (
    decode_action,
    normalizer_stats,
    recorded_actions,
    resolve_frequency,
    shape_meta,
    split_episodes,
)
from dpflow_core.train.logs import JsonLinesLogger, WandbRun
from dpflow_core.train.policy import DiffusionUnetImagePolicy, build_policy, optimizer_param_groups
from dpflow_core.train.reporting import Reporter, open_reporter
from dpflow_core.train.sampler import EpochBatchSampler

log = logging.getLogger("dpflow.train")

LOG_NAME = "logs.json.txt"
CHECKPOINT_DIR = "checkpoints"


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy's global generator and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch




def _fresh_accelerator_state(mixed_precision: str) -> None:
    """Let a second training in the same process use another ``mixed_precision`` than the first (a test worker, a
    notebook): accelerate keeps one process-wide state and refuses a change; it is reset, not the process state
    (devices, ranks) it shares with the launcher."""
    from accelerate.state import AcceleratorState

    if AcceleratorState._shared_state and AcceleratorState._shared_state.get("_mixed_precision") not in (
            None, mixed_precision):
        AcceleratorState._reset_state()


class Workspace:
    """One training run: built from the resolved config and the Hydra run directory."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path):
        from accelerate import Accelerator

        check_config(cfg)
        self.speed = throughput_settings(cfg)
        self.cfg = cfg
        # "auto": bf16 autocast where the hardware computes bf16 natively (mixed_precision_of), else float32
        self.mixed_precision = mixed_precision_of(cfg)
        _fresh_accelerator_state(self.mixed_precision)
        self.accelerator = Accelerator(mixed_precision=self.mixed_precision, step_scheduler_with_optimizer=False)
        asked = cfg.training.mixed_precision
        log.info("mixed precision: %s (training.mixed_precision: %s%s)", self.mixed_precision, asked,
                 f": {bf16_reason(self.accelerator.device.type)}" if asked == "auto" else "")
        acc = self.accelerator
        self.is_main = acc.is_main_process
        self.rank = acc.process_index
        self.world = acc.num_processes
        self.device = acc.device
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.speed["allow_tf32"]
            torch.backends.cudnn.allow_tf32 = self.speed["allow_tf32"]
        if not self.is_main:
            # the main process reports for all; the others only warn
            for name in ("dpflow.train", "dpflow_core"):
                logging.getLogger(name).setLevel(logging.WARNING)
        self.run_dir = self._shared_run_dir(Path(run_dir))
        self.ckpt_dir = self.run_dir / CHECKPOINT_DIR
        self.latest_path = self.ckpt_dir / ckpt.LATEST_NAME
        self.log_path = self.run_dir / LOG_NAME
        self.wandb: WandbRun | None = None
        self.json_log: JsonLinesLogger | None = None
        # reports to Dagster when launched through Dagster Pipes (main process only; None otherwise)
        self.pipes: Reporter | None = None

    def _shared_run_dir(self, own: Path) -> Path:
        """Every process uses the main process's run directory (``${now:...}`` may differ by a second)."""
        if self.world == 1:
            return own
        from accelerate.utils import broadcast_object_list

        shared = [str(own.resolve())]
        broadcast_object_list(shared, from_process=0)
        path = Path(shared[0])
        if path != own.resolve() and own.is_dir() and not any(own.iterdir()):
            own.rmdir()  # created by Hydra in this process, never used
        return path

    # Setup -------------------------------------------------------------------------

    def _setup_data(self) -> None:
        cfg = self.cfg
        task = cfg.task
        self.buffer = buffer = ReplayBuffer(task.dataset_path)
        if task.image_size is not None:
            want = [int(v) for v in task.image_size]
            if list(buffer.metadata["image_size"]) != want:
                raise DatasetError(
                    f"images are {buffer.metadata['image_size']} (W, H) but task.image_size={want}; convert at "
                    "that size or pass task.image_size=null to train at the dataset's size",
                    path=buffer.path,
                )
        self.frequency_hz = resolve_frequency(task.dataset_frequeny, buffer)
        try:
            self.spec = spec = spec_from_config(cfg, self.frequency_hz, buffer.metadata)
            train_mask, val_mask = split_episodes(
                buffer.n_episodes, float(task.val_ratio), int(task.split_seed), int(task.get("val_min_episodes", 1))
            )
        except ValueError as exc:
            raise DatasetError(str(exc), path=buffer.path) from exc
        self.shape_meta = shape_meta(buffer, spec)
        self.train_set = SequenceDataset(buffer, spec, train_mask)
        self.val_set = SequenceDataset(buffer, spec, val_mask)
        if len(self.train_set) == 0:
            raise DatasetError(
                f"no training sample: every training episode is shorter than {spec.min_episode_length} frames "
                f"((horizon - 1) x action_down_sample_steps + 1 = ({spec.horizon} - 1) x "
                f"{spec.action_down_sample_steps} + 1)",
                path=buffer.path,
            )
        if val_mask.any() and len(self.val_set) == 0:
            log.warning("validation episodes are all shorter than %d frames: no validation", spec.min_episode_length)
        self.norm_stats = normalizer_stats(buffer, spec, train_mask)
        seed = int(cfg.training.seed)
        self.train_sampler = EpochBatchSampler(
            len(self.train_set),
            int(cfg.dataloader.batch_size),
            shuffle=bool(cfg.dataloader.shuffle),
            seed=seed,
            num_replicas=self.world,
            rank=self.rank,
            max_batches=cfg.training.max_train_steps,
        )
        self.train_loader = self._loader(self.train_set, self.train_sampler, cfg.dataloader, seed)
        self.val_sampler = self.val_loader = None
        if len(self.val_set):
            self.val_sampler = EpochBatchSampler(
                len(self.val_set),
                int(cfg.val_dataloader.batch_size),
                shuffle=bool(cfg.val_dataloader.shuffle),
                seed=seed + 1,
                num_replicas=self.world,
                rank=self.rank,
                max_batches=cfg.training.max_val_steps,
            )
            self.val_loader = self._loader(self.val_set, self.val_sampler, cfg.val_dataloader, seed + 1)
        log.info(
            "dataset %s: %d episodes, %d steps at %.4g Hz; %d training and %d validation samples; latency steps %s",
            buffer.path,
            buffer.n_episodes,
            buffer.n_steps,
            buffer.frequency_hz,
            len(self.train_set),
            len(self.val_set),
            dict(spec.obs_latency_steps),
        )

    def _loader(self, dataset, sampler: EpochBatchSampler, dl_cfg: DictConfig, seed: int) -> DataLoader:
        workers = int(dl_cfg.num_workers)
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=workers,
            # whole batches from SequenceDataset.__getitems__, gathered into one buffer each
            collate_fn=pass_batch,
            pin_memory=bool(dl_cfg.pin_memory) and self.device.type == "cuda",
            persistent_workers=bool(dl_cfg.persistent_workers) and workers > 0,
            # A private generator: creating an iterator must not consume the global RNG,
            # or a run resumed mid-epoch would draw different noise.
            generator=torch.Generator().manual_seed(seed),
        )

    def _check_run_dir(self) -> None:
        """Refuse to overwrite an earlier run; require its checkpoint when resuming."""
        if self.cfg.training.resume:
            if not self.latest_path.is_file():
                raise RunError(
                    "training.resume=true but there is no checkpoint to resume from; pass the run's "
                    "hydra.run.dir (and checkpoint.save_last_ckpt must have been true)",
                    path=self.latest_path,
                    code="checkpoint_missing",
                )
        elif self.latest_path.exists() or self.log_path.exists():
            raise RunError(
                "this run directory already holds a run; pass training.resume=true to continue it, or choose a "
                "new hydra.run.dir",
                path=self.run_dir,
                code="run_exists",
            )

    def _build(self) -> None:
        cfg = self.cfg
        acc = self.accelerator
        seed_everything(int(cfg.training.seed))  # identical initial weights in every process
        policy = build_policy(
            OmegaConf.to_container(cfg.policy, resolve=True),
            self.spec,
            int(cfg.n_action_steps),
            self.shape_meta,
            self.norm_stats,
            noise_samples_per_obs=self.speed["noise_samples_per_obs"],
        ).to(self.device)
        opt = cfg.optimizer
        optimizer = torch.optim.AdamW(
            optimizer_param_groups(policy, float(opt.lr), obs_encoder_lr_scale(cfg)),
            lr=float(opt.lr),
            betas=tuple(float(b) for b in opt.betas),
            eps=float(opt.eps),
            weight_decay=float(opt.weight_decay),
        )
        self.model, self.optimizer = acc.prepare(policy, optimizer)
        self.policy: DiffusionUnetImagePolicy = acc.unwrap_model(self.model)
        self.batches_per_epoch = self.train_sampler.batches_per_epoch()
        accum = int(cfg.training.gradient_accumulate_every)
        total_updates = math.ceil(self.batches_per_epoch / accum) * int(cfg.training.num_epochs)
        from diffusers.optimization import get_scheduler

        self.lr_scheduler = get_scheduler(
            str(cfg.training.lr_scheduler),
            optimizer=self.optimizer,
            num_warmup_steps=int(cfg.training.lr_warmup_steps),
            num_training_steps=total_updates,
        )
        self.ema = self.ema_policy = None
        if cfg.training.use_ema:
            from diffusers.training_utils import EMAModel

            e = cfg.ema
            self.ema = EMAModel(
                self.policy.parameters(),
                decay=float(e.max_value),
                min_decay=float(e.min_value),
                update_after_step=int(e.update_after_step),
                use_ema_warmup=True,
                inv_gamma=float(e.inv_gamma),
                power=float(e.power),
            )
            self.ema_policy = copy.deepcopy(self.policy).eval()
            self.ema_policy.requires_grad_(False)
        c = cfg.checkpoint
        self.topk = ckpt.TopKCheckpoints(
            self.ckpt_dir, str(c.topk.monitor_key), str(c.topk.mode), int(c.topk.k), str(c.topk.format_str)
        )
        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.epoch_losses: list[float] = []
        self.wandb_id: str | None = None

    def _restore(self) -> None:
        """Load ``latest.ckpt`` and continue exactly where it was written."""
        payload = ckpt.load_checkpoint(self.latest_path, require_complete=True)
        self.policy.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.lr_scheduler.load_state_dict(payload["lr_scheduler"])
        if self.ema is not None:
            if payload["ema"] is None:
                raise RunError("training.use_ema=true but the checkpoint has no EMA state", path=self.latest_path)
            self.ema.load_state_dict(payload["ema"])
            # the averaged weights are stored once, as the "policy" entry
            with torch.no_grad():
                for shadow, (name, _) in zip(self.ema.shadow_params, self.policy.named_parameters()):
                    shadow.copy_(payload["policy"][name])
        scaler = self.accelerator.scaler
        if scaler is not None:
            if payload["grad_scaler"]["state"] is None:
                raise RunError(
                    "this run uses a grad scaler (fp16) but the checkpoint's run did not; resume with its "
                    "training.mixed_precision",
                    path=self.latest_path,
                )
            scaler.load_state_dict(payload["grad_scaler"]["state"])
        self.topk.load_state_dict(payload["topk"])
        gone = self.topk.reconcile()
        if gone:
            log.warning("top-k files missing on disk, dropped from the index: %s", gone)
        self.epoch = int(payload["epoch"])
        self.batch_in_epoch = int(payload["batch_in_epoch"])
        self.global_step = int(payload["global_step"])
        self.wandb_id = payload["wandb_id"]
        diffs = self.train_sampler.order_differences(payload["sampler"])
        if diffs:
            log.warning(
                "the data order differs from the checkpoint's (%s); epoch %d restarts from its first batch",
                "; ".join(diffs),
                self.epoch,
            )
            self.batch_in_epoch = 0
        if self.batch_in_epoch > self.batches_per_epoch:
            self.batch_in_epoch = 0
        states = payload["rank_states"]
        if int(payload["num_processes"]) == self.world and not diffs:
            ckpt.restore_rng_state(states[self.rank]["rng"])
            self.epoch_losses = [float(v) for v in states[self.rank]["epoch_losses"]]
        else:
            log.warning(
                "checkpoint written by %s processes, now %d: RNG states are seeded afresh, so the run "
                "continues correctly but not bit-identically",
                payload["num_processes"],
                self.world,
            )
            seed_everything(int(self.cfg.training.seed) + self.rank + 1000 * self.global_step)
            self.epoch_losses = []
            self.batch_in_epoch = 0
        ds = payload["dataset"]
        if ds.get("n_steps") != self.buffer.n_steps or ds.get("n_episodes") != self.buffer.n_episodes:
            log.warning("the dataset differs from the checkpoint's (%s): %s", ds, self.buffer)
        log.info(
            "resumed from %s: epoch %d, batch %d, global_step %d",
            self.latest_path,
            self.epoch,
            self.batch_in_epoch,
            self.global_step,
        )

    # Checkpoints --------------------------------------------------------------------

    def _eval_policy(self) -> DiffusionUnetImagePolicy:
        """The weights used for evaluation: the EMA (copied into its module) or the trained ones."""
        if self.ema is None:
            return self.policy
        self.ema.copy_to(self.ema_policy.parameters())
        return self.ema_policy

    def _dataset_sha256(self) -> str:
        """SHA-256 of the training dataset, hashed once at the first save (evaluation checks it)."""
        if getattr(self, "dataset_sha256", None) is None:
            from dpflow_core.files import sha256_file

            self.dataset_sha256 = sha256_file(self.buffer.path)
        return self.dataset_sha256

    def _payload(self, rank_states: list[dict[str, Any]]) -> dict[str, Any]:
        scaler = self.accelerator.scaler
        return {
            "format": ckpt.FORMAT,
            "format_version": ckpt.FORMAT_VERSION,
            "cfg": OmegaConf.to_yaml(self.cfg, resolve=True),
            "shape_meta": self.shape_meta,
            "spec": ckpt.spec_to_payload(self.spec),
            "normalizer": {k: {s: torch.from_numpy(v) for s, v in st.items()} for k, st in self.norm_stats.items()},
            "dataset": {
                "path": str(self.buffer.path),
                "n_episodes": self.buffer.n_episodes,
                "n_steps": self.buffer.n_steps,
                "frequency_hz": self.buffer.frequency_hz,
                "sha256": self._dataset_sha256(),
            },
            "tx_cam_tcp": [list(r) for r in self.spec.tx_cam_tcp],
            "model": self.policy.state_dict(),
            "ema": None
            if self.ema is None
            else {k: v for k, v in self.ema.state_dict().items() if k != "shadow_params"},
            "policy": self._eval_policy().state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "grad_scaler": {"used": scaler is not None, "state": None if scaler is None else scaler.state_dict()},
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "global_step": self.global_step,
            "sampler": {**self.train_sampler.state_dict(), "epoch": self.epoch, "start_batch": self.batch_in_epoch},
            "topk": self.topk.state_dict(),
            "num_processes": self.world,
            "rank_states": rank_states,
            "wandb_id": self.wandb_id,
        }

    def save(self, metrics: Mapping[str, Any] | None = None) -> None:
        """Write ``latest.ckpt`` (and a top-k file when ``metrics`` qualify). Collective."""
        c = self.cfg.checkpoint
        mine = {"rng": ckpt.capture_rng_state(), "epoch_losses": list(self.epoch_losses)}
        if self.world > 1:
            from accelerate.utils import gather_object

            states = gather_object([mine])
        else:
            states = [mine]
        if self.is_main:
            name, evicted = self.topk.propose(metrics) if metrics is not None else (None, [])
            if c.save_last_ckpt or name:
                payload = self._payload(states)
                written = []
                if c.save_last_ckpt:
                    written.append(ckpt.atomic_save(payload, self.latest_path))
                    if name:
                        written.append(ckpt.atomic_copy(self.latest_path, self.ckpt_dir / name))
                else:
                    written.append(ckpt.atomic_save(payload, self.ckpt_dir / name))
                del payload
                if self.pipes is not None:
                    for path in written:
                        self.pipes.checkpoint_saved(Path(path), self.global_step - 1, self.epoch - 1 if metrics else self.epoch)
                for old in evicted:
                    (self.ckpt_dir / old).unlink(missing_ok=True)
        self.accelerator.wait_for_everyone()

    # Loop -----------------------------------------------------------------------------

    def _log(self, record: Mapping[str, Any]) -> None:
        if self.json_log is not None:
            self.json_log.log(record)
        if self.pipes is not None:
            self.pipes.step(record, force=bool(record.get("epoch_summary")))
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "epoch_summary"}, step=int(record["global_step"]))

    def _reduce_mean(self, total: float, count: float) -> float:
        t = torch.tensor([total, count], dtype=torch.float64, device=self.device)
        if self.world > 1:
            t = self.accelerator.reduce(t, reduction="sum")
        return float(t[0] / t[1]) if t[1] > 0 else float("nan")

    @torch.no_grad()
    def _validate(self, policy: DiffusionUnetImagePolicy) -> float:
        total = count = 0.0
        self.val_sampler.set_epoch(0)
        with self.accelerator.autocast():
            for batch in self.val_loader:
                batch = _to_device(batch, self.device)
                n = batch["action"].shape[0]
                total += float(policy.compute_loss(batch)) * n
                count += n
        return self._reduce_mean(total, count)

    @torch.no_grad()
    def _action_mse(self, policy: DiffusionUnetImagePolicy, dataset: SequenceDataset, indices: list[int]) -> float:
        """MSE of sampled actions in absolute dataset units (m, rad, m), the representation undone."""
        s = dataset.samples(indices)
        obs = {k: torch.from_numpy(np.ascontiguousarray(v)).to(self.device) for k, v in s["obs"].items()}
        with self.accelerator.autocast():
            pred = policy.predict_action(obs)["action_pred"]
        absolute = decode_action(pred.float().cpu().numpy(), s["base"], self.spec)
        recorded = recorded_actions(self.buffer, self.spec, dataset.index[np.asarray(indices, dtype=np.int64)])
        return self._reduce_mean(float(((absolute - recorded) ** 2).sum()), float(recorded.size))

    def train_step(self, batch: Mapping[str, Any], update: bool = True, accum: int = 1) -> float:
        """Forward and backward on one batch already on the device; with ``update``, the optimizer,
        schedule and EMA step. Returns the batch's loss (mean over B x K denoising samples)."""
        acc = self.accelerator
        with contextlib.nullcontext() if update else acc.no_sync(self.model):
            loss = self.model(batch)
            acc.backward(loss / accum)
        if update:
            self.optimizer.step()
            self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.ema is not None:
                self.ema.step(self.policy.parameters())
        return float(loss.detach())

    def _train_epoch(self) -> None:
        cfg = self.cfg
        accum = int(cfg.training.gradient_accumulate_every)
        every_n = cfg.checkpoint.every_n_steps
        n = self.batches_per_epoch
        self.train_sampler.set_epoch(self.epoch, self.batch_in_epoch)
        self.model.train()
        bar = None
        if self.is_main:
            from tqdm import tqdm

            bar = tqdm(
                total=n,
                initial=self.batch_in_epoch,
                desc=f"epoch {self.epoch}",
                leave=False,
                mininterval=float(cfg.training.tqdm_interval_sec),
                file=sys.stderr,
            )
        batches = iter(self.train_loader)
        while True:
            waited = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            batch = _to_device(batch, self.device)
            # what the step waited for its batch (loading, collation, the copy to the device)
            data_time = time.perf_counter() - waited
            b = self.batch_in_epoch
            update = (b + 1) % accum == 0 or b + 1 == n
            value = self.train_step(batch, update, accum)
            self.epoch_losses.append(value)
            if self.is_main:
                self._log(
                    {
                        "train_loss": value,
                        "global_step": self.global_step,
                        "epoch": self.epoch,
                        "lr": self.lr_scheduler.get_last_lr()[0],
                        "data_time_s": round(data_time, 6),
                    }
                )
                bar.update(1)
                bar.set_postfix(loss=f"{value:.4f}", refresh=False)
            self.global_step += 1
            self.batch_in_epoch += 1
            if (
                every_n
                and update
                and self.global_step % int(every_n) == 0
                and self.batch_in_epoch < n
                and cfg.checkpoint.save_last_ckpt
            ):
                self.save()
        if bar is not None:
            bar.close()

    def _end_epoch(self) -> dict[str, Any]:
        cfg = self.cfg
        t = cfg.training
        e = self.epoch
        metrics: dict[str, Any] = {
            "train_loss": self._reduce_mean(sum(self.epoch_losses), len(self.epoch_losses)),
            "global_step": self.global_step - 1,
            "epoch": e,
            "lr": self.lr_scheduler.get_last_lr()[0],
        }
        if self.val_loader is not None and e % int(t.val_every) == 0:
            # the raw weights, as Diffusion Policy validates; sampling below uses the EMA
            self.policy.eval()
            metrics["val_loss"] = self._validate(self.policy)
            self.policy.train()
        policy = self._eval_policy()
        policy.eval()
        if e % int(t.sample_every) == 0:
            metrics["train_action_mse_error"] = self._action_mse(policy, self.train_set, self.train_sampler.batch(e, 0))
            if self.val_sampler is not None:
                metrics["val_action_mse_error"] = self._action_mse(policy, self.val_set, self.val_sampler.batch(0, 0))
        if self.is_main:
            self._log({**metrics, "epoch_summary": True})
        self.epoch += 1
        self.batch_in_epoch = 0
        self.epoch_losses = []
        done = self.epoch == int(t.num_epochs)
        if self.epoch % int(t.checkpoint_every) == 0 or done:
            self.save(metrics)
        return metrics

    def run(self) -> dict[str, Any]:
        """Train to ``training.num_epochs``; returns a summary (run_dir, epoch, global_step, last metrics)."""
        cfg = self.cfg
        self._setup_data()
        self._check_run_dir()
        self.accelerator.wait_for_everyone()  # every process checked before the main one writes
        self._build()
        if cfg.training.resume:
            self._restore()
        else:
            seed_everything(int(cfg.training.seed) + self.rank)
        if self.is_main:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            removed = ckpt.remove_stale_temp_files(self.ckpt_dir)
            if removed:
                log.warning("removed temporary files of an interrupted save: %s", [p.name for p in removed])
            self.json_log = JsonLinesLogger(
                self.log_path, keep_before_step=self.global_step if cfg.training.resume else None
            )
            if self.json_log.dropped:
                log.warning(
                    "dropped %d log lines written after the checkpoint (work lost at the interruption)",
                    self.json_log.dropped,
                )
            self.pipes = open_reporter(
                total_steps=int(cfg.training.num_epochs) * self.batches_per_epoch, start_step=self.global_step
            )
            if str(cfg.logging.mode) != "disabled":
                resolved = OmegaConf.to_container(cfg, resolve=True)
                self.wandb = WandbRun(cfg, self.run_dir, self.wandb_id, resolved)
                self.wandb_id = self.wandb.id
        log.info(
            "training %s on %d process(es) (%d torch thread(s) each), %d batches per epoch, "
            "%d noise sample(s) per observation, from epoch %d to %d",
            self.run_dir,
            self.world,
            torch.get_num_threads(),
            self.batches_per_epoch,
            self.speed["noise_samples_per_obs"],
            self.epoch,
            int(cfg.training.num_epochs),
        )
        metrics: dict[str, Any] = {}
        exit_code = 1
        started = time.monotonic()
        try:
            while self.epoch < int(cfg.training.num_epochs):
                self._train_epoch()
                metrics = self._end_epoch()
            exit_code = 0
        finally:
            if self.json_log is not None:
                self.json_log.close()
            if self.wandb is not None:
                self.wandb.finish(exit_code=exit_code)
            if self.pipes is not None and exit_code != 0:
                self.pipes.close()
        self.accelerator.wait_for_everyone()
        self.accelerator.end_training()
        log.info(
            "training finished in %.1f s: epoch %d, global_step %d",
            time.monotonic() - started,
            self.epoch,
            self.global_step,
        )
        summary = {
            "run_dir": str(self.run_dir),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "latest_checkpoint": str(self.latest_path) if self.latest_path.exists() else None,
            "metrics": metrics,
        }
        if self.pipes is not None:
            try:
                self.pipes.finish(summary, int(cfg.training.num_epochs))
            finally:
                self.pipes.close()
        return summary


def train(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run the trainer with a composed config in ``run_dir`` (see :class:`Workspace`).

    Raises:
        DatasetError: the dataset is missing, invalid, or yields no training sample.
        RunError: a bad setting, a run directory that already holds a run (without
            ``training.resume=true``), or a missing/incomplete checkpoint on resume.
    """
    workspace = Workspace(cfg, run_dir)
    before = apply_threads(workspace.speed["torch_threads"])
    try:
        return workspace.run()
    finally:
        # a trainer run inside a longer process (tests, notebooks) leaves torch as it found it
        torch.set_num_threads(before)
