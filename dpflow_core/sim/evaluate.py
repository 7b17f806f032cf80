"""The closed-loop judge of a checkpoint trained on a world task: rollouts, baselines, the verdict, the film.

:func:`evaluate_closed_loop` rolls the policy out on held-out initial states
(:mod:`dpflow_core.sim.rollout`), beside the baselines on the same states, and
writes into its output folder:

- ``rollouts.json`` (the policy) and ``rollouts_<baseline>.json``: one record per episode;
- ``closed_loop.json``: each predictor's success rate with its Wilson 95 % interval, the settings and
  the verdict of the ``closed_loop_success`` rule;
- ``rollouts.mp4`` (the first episodes: wrist camera beside a scene camera) and ``contact_sheet.png``.

Besides the scripted baselines, other policies can be rolled out as baselines on the same states
(``baseline_policies``): a policy trained without the camera, which shows what seeing is worth, or an
earlier checkpoint. The verdict passes when the policy's success reaches ``target`` and exceeds every
non-oracle baseline's by at least ``margin`` (absolute). The oracle (the scripted demonstrator) must itself reach
:data:`ORACLE_MIN`: below that the world, not the policy, is broken, and the verdict says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Mapping, Sequence

import cv2
import numpy as np

from dpflow_core.errors import RunError
from dpflow_core.files import atomic_path, write_text_atomic
from dpflow_core.results import StageResult
from dpflow_core.sim.record import SimRecordingSpec
from dpflow_core.sim.settings import ClosedLoopSettings  # noqa: F401 (re-exported: its callers' name)
from dpflow_core.sim.rollout import (
    BASELINES,
    RolloutSummary,
    check_held_out,
    eval_seeds,
    rollout_baseline,
    rollout_policy,
    write_rollouts,
)
from dpflow_core.sim.tasks import SUCCESS_TARGET, check_disjoint, check_task
from dpflow_core.sim.world import GripperWorld

ORACLE_MIN = 0.98
#: Simulated seconds between two frames of the film.
FILM_DT_S = 0.2


@dataclass(frozen=True)
class ClosedLoopResult(StageResult):
    """What :func:`evaluate_closed_loop` measured (see the module docstring).

    Attributes:
        task: the task; simulated: False for a lab's recordings (nothing was rolled out, see
            :meth:`not_simulated`); episodes: rollouts per predictor; seeds: the first and last held-out seed.
        policy: the policy's summary as a dict (``success_rate``, ``wilson_low``, ``wilson_high``, ...).
        baselines: ``{name: summary dict}``.
        target, margin: of the verdict; passed: the verdict; reason: why it failed ("" when it passed).
        out_dir, video, contact_sheet: the written files (video and sheet None when not filmed).
        n_action_steps: the actions every policy executed of each chunk (None: nothing rolled out).
    """

    task: str
    simulated: bool
    episodes: int
    seeds: tuple[int, ...]
    policy: dict[str, Any]
    baselines: dict[str, Any]
    target: float | None
    margin: float
    passed: bool
    reason: str
    out_dir: Path
    video: Path | None
    contact_sheet: Path | None
    n_action_steps: int | None = None

    @classmethod
    def not_simulated(cls, task: str, settings: ClosedLoopSettings) -> "ClosedLoopResult":
        """The result for a task that does not come from the world: nothing rolled out, nothing judged."""
        return cls(task, False, 0, (), {}, {}, settings.target, settings.margin, True,
                   "no simulator for this task", Path("."), None, None)

    def table(self) -> str:
        """A markdown table: predictor, successes, rate, Wilson 95 % interval."""
        rows = ["| predictor | successes | success | Wilson 95 % |", "|---|---:|---:|---|"]
        for name, s in [("policy", self.policy)] + sorted(self.baselines.items()):
            rows.append(f"| {name} | {s['successes']}/{s['n']} | {100 * s['success_rate']:.1f} % | "
                        f"{100 * s['wilson_low']:.1f}-{100 * s['wilson_high']:.1f} % |")
        return "\n".join(rows)


def verdict(policy: RolloutSummary, baselines: Sequence[RolloutSummary], target: float, margin: float) -> tuple[bool, str]:
    """The ``closed_loop_success`` rule: ``(passed, reason)``."""
    oracle = next((b for b in baselines if b.name == "oracle"), None)
    if oracle is not None and oracle.success_rate < ORACLE_MIN:
        return False, f"the oracle succeeded {100 * oracle.success_rate:.1f} % < {100 * ORACLE_MIN:.0f} %: the world is broken"
    if policy.success_rate < target:
        return False, f"policy success {100 * policy.success_rate:.1f} % < target {100 * target:.0f} %"
    for b in baselines:
        if b.name != "oracle" and policy.success_rate < b.success_rate + margin:
            return False, (f"policy success {100 * policy.success_rate:.1f} % does not beat {b.name} "
                           f"({100 * b.success_rate:.1f} %) by {100 * margin:.0f} points")
    return True, ""


class _Film:
    """Frames of the first episodes: the wrist camera beside the scene camera, every ``FILM_DT_S``."""

    def __init__(self):
        self.frames: list[list[np.ndarray]] = []
        self._next: dict[int, float] = {}

    def __call__(self, episode: int, world: GripperWorld) -> None:
        if world.time_s + 1e-9 < self._next.get(episode, 0.0):
            return
        self._next[episode] = world.time_s + FILM_DT_S
        while len(self.frames) <= episode:
            self.frames.append([])
        wrist = cv2.resize(world.render("wrist", 128, 128), (120, 120), interpolation=cv2.INTER_AREA)
        scene = world.render("scene", 160, 120)
        frame = np.concatenate([wrist, scene], axis=1)
        cv2.putText(frame, f"ep {episode} t {world.time_s:4.1f}s", (2, 10), cv2.FONT_HERSHEY_PLAIN, 0.7, (255, 255, 255))
        self.frames[episode].append(frame)

    def write(self, out_dir: Path) -> tuple[Path | None, Path | None]:
        if not self.frames:
            return None, None
        import av

        video = out_dir / "rollouts.mp4"
        with atomic_path(video, suffix=".mp4") as tmp:
            with av.open(str(tmp), "w") as container:
                stream = container.add_stream("libx264", rate=Fraction(1, 1) / Fraction(FILM_DT_S).limit_denominator())
                h, w = self.frames[0][0].shape[:2]
                stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
                for frame in (f for ep in self.frames for f in ep):
                    for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                        container.mux(packet)
                for packet in stream.encode(None):
                    container.mux(packet)
        per_row = 8
        rows = []
        for ep in self.frames:
            picks = [ep[i] for i in np.linspace(0, len(ep) - 1, per_row).round().astype(int)]
            rows.append(np.concatenate(picks, axis=1))
        sheet = out_dir / "contact_sheet.png"
        with atomic_path(sheet, suffix=".png") as tmp:
            cv2.imwrite(str(tmp), cv2.cvtColor(np.concatenate(rows, axis=0), cv2.COLOR_RGB2BGR))
        return video, sheet


def evaluate_closed_loop(
    policy,
    task: str,
    out_dir: str | Path,
    settings: ClosedLoopSettings = ClosedLoopSettings(),
    training_seeds: Sequence[int] | None = None,
    recording: SimRecordingSpec = SimRecordingSpec(),
    overwrite: bool = False,
    baseline_policies: Mapping[str, Any] | None = None,
) -> ClosedLoopResult:
    """Roll ``policy`` (a loaded :class:`~dpflow_core.inference.Policy`, a
    :class:`~dpflow_core.serving.client.RemotePolicy`, or a path to a checkpoint) and the baselines out on
    held-out initial states of ``task``; write the files of the module docstring into ``out_dir``.

    ``baseline_policies`` maps a name (a lower-case word, none of :data:`BASELINES` nor ``policy``) to a
    further policy of the same kinds, rolled out as a baseline into ``rollouts_<name>.json``.

    Raises:
        RunError: ``out_dir`` already holds ``closed_loop.json`` and ``overwrite`` is False.
        ValueError: an unknown task, rollout seeds that meet ``training_seeds``, or a bad baseline name.
    """
    check_task(task)
    others = dict(baseline_policies or {})
    for name in others:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or name in BASELINES or name == "policy":
            raise ValueError(f"baseline policy name {name!r}: a lower-case word, not 'policy' nor one of {list(BASELINES)}")
    out = Path(out_dir)
    if (out / "closed_loop.json").exists() and not overwrite:
        raise RunError("closed-loop results exist already (pass --overwrite to replace them)", path=out, code="exists")
    s = settings
    episodes, baselines, margin, video_episodes = s.episodes, s.baselines, s.margin, s.video_episodes
    target = SUCCESS_TARGET[task] if s.target is None else s.target
    seeds = eval_seeds(episodes, s.seed)
    check_held_out(seeds)
    if training_seeds is not None:
        check_disjoint(training_seeds, seeds)
    from dpflow_core.inference import load_policy

    loaded = lambda p: load_policy(p) if isinstance(p, (str, Path)) else p  # noqa: E731
    policy, others = loaded(policy), {k: loaded(v) for k, v in others.items()}
    from dpflow_core.sim.rollout import PolicyView

    # every policy of the run executes the same number: the setting, else the judged policy's own
    n_exec = s.n_action_steps if s.n_action_steps is not None else PolicyView.of(policy).n_action_steps
    for name, p in [("policy", policy), *others.items()]:  # before any folder or rollout: what is known up front
        horizon = getattr(p, "horizon", None)
        if isinstance(horizon, int) and n_exec > horizon:
            raise ValueError(f"n_action_steps {n_exec} exceeds the {horizon} actions {name} predicts per chunk (its horizon)")
    out.mkdir(parents=True, exist_ok=True)
    film = _Film()
    records = rollout_policy(policy, task, seeds, recording, n_action_steps=n_exec, video=film,
                             video_episodes=video_episodes)
    write_rollouts(out, "policy", records)
    summaries = []
    for name in baselines:
        base = rollout_baseline(name, task, seeds, train_seed=int(training_seeds[0]) if training_seeds else 0)
        write_rollouts(out, name, base)
        summaries.append(RolloutSummary.of(name, base))
    for name, other in others.items():
        base = rollout_policy(other, task, seeds, recording, n_action_steps=n_exec)
        write_rollouts(out, name, base)
        summaries.append(RolloutSummary.of(name, base))
    mine = RolloutSummary.of("policy", records)
    passed, reason = verdict(mine, summaries, target, margin)
    video, sheet = film.write(out)
    result = ClosedLoopResult(
        task, True, episodes, (seeds[0], seeds[-1]), mine.__dict__ | {}, {s.name: dict(s.__dict__) for s in summaries},
        float(target), float(margin), passed, reason, out, video, sheet, records[0].n_action_steps,
    )
    write_text_atomic(out / "closed_loop.json", json.dumps(result.to_dict(), indent=2))
    return result


def closed_loop_for_task(checkpoint: str | Path, task_dir: str | Path, out_dir: str | Path,
                         settings: ClosedLoopSettings = ClosedLoopSettings(), overwrite: bool = False,
                         baseline_policies: Mapping[str, Any] | None = None) -> ClosedLoopResult:
    """The closed-loop judge of a checkpoint trained on the recordings of ``task_dir``.

    A task folder recorded in the world (it holds ``sim_task.json``) is rolled out with the world's
    task, its recording settings and its training seeds (asserted disjoint from the rollouts'); any
    other folder gives :meth:`ClosedLoopResult.not_simulated`.

    Raises:
        ValueError: ``sim_task.json`` unreadable or not the world's; RunError: see :func:`evaluate_closed_loop`.
    """
    from dpflow_core.sim.record import read_sim_task

    meta = read_sim_task(task_dir)
    if meta is None:
        return ClosedLoopResult.not_simulated(Path(task_dir).name, settings)
    known = {f.name for f in SimRecordingSpec.__dataclass_fields__.values()}
    recording = SimRecordingSpec(**{k: v for k, v in (meta.get("recording") or {}).items() if k in known})
    seeds = [int(e["seed"]) for e in meta["episodes"]]
    return evaluate_closed_loop(checkpoint, meta["task"], out_dir, settings, training_seeds=seeds,
                                recording=recording, overwrite=overwrite, baseline_policies=baseline_policies)
