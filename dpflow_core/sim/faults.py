"""Bad demonstrations on purpose: the faults a curation step must find, with their ground truth.

A lab's recordings always hold some demonstrations that hurt training. This module
writes the common kinds into the world's recordings, each a transformation of the
demonstrator's :class:`~dpflow_core.sim.demonstrator.Plan` (the TCP target track at
:data:`~dpflow_core.sim.world.CONTROL_HZ`) or of the list of episodes:

- ``idle``: the person stops for 2.5-5 s (a hand holding still, tremor only) at the
  start, before the grasp or mid-carry;
- ``wrong_target``: the block is carried to a spot 8-12 cm from the pad and put down
  there (off the pad: the episode fails the task);
- ``dropped``: the fingers open early in the carry, the block falls, and the hand goes on to
  the pad and "places" nothing;
- ``regrasp``: a hesitant grasp: the fingers close on the block, open again, the hand
  rises 3-5 cm, comes down a few millimetres off and closes again (one or two loops);
- ``duplicate``: the same demonstration recorded a second time, under another stem,
  with the second recording's own sensor noise and timing (not a byte copy: pairing
  already rejects those, ``duplicate_episode``).

The ground truth goes in ``curation_truth.json`` (:data:`TRUTH_FILE`) in the task
folder: per stem, whether it is bad, its kind and the fault's figures (times in
seconds from the episode's start). dpflow's curation never reads it; only tests and
studies compare against it.

A duplicate's ``sim_task.json`` entry keeps the seed of its own slot (so every
episode has a distinct seed below the rollouts' range), while its initial state is
its source's: the truth file names the source.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpflow_core.files import write_text_atomic
from dpflow_core.sim.demonstrator import Plan, plan
from dpflow_core.sim.tasks import InitialState
from dpflow_core.sim.world import CONTROL_HZ, MAX_OPENING_M

KINDS = ("idle", "wrong_target", "dropped", "regrasp", "duplicate")
TRUTH_FILE = "curation_truth.json"
_DT = 1.0 / CONTROL_HZ


@dataclass(frozen=True)
class FaultSpec:
    """Which bad demonstrations to write: ``bad_fraction`` of the episodes (rounded), of ``kinds``
    (each a name of :data:`KINDS`, spread evenly over the bad episodes), chosen with ``seed``."""

    bad_fraction: float = 0.2
    kinds: tuple[str, ...] = KINDS
    seed: int = 0

    def validate(self) -> "FaultSpec":
        """``self``; ValueError naming the bad value otherwise."""
        if not 0.0 <= self.bad_fraction <= 1.0:
            raise ValueError(f"bad_fraction must be in [0, 1], got {self.bad_fraction}")
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown or not self.kinds:
            raise ValueError(f"unknown fault kinds {unknown or '(none given)'}: the world writes {list(KINDS)}")
        return self


def _events(p: Plan) -> tuple[int, int, int]:
    """Indices of the track where the fingers start closing, are closed, and start opening again."""
    closing = np.flatnonzero(p.opening < MAX_OPENING_M - 1e-4)
    start = int(closing[0])
    closed = start + int(np.flatnonzero(p.opening[start:] <= 1e-4)[0])
    release = closed + int(np.flatnonzero(p.opening[closed:] > 1e-4)[0])
    return start, closed, release


def _splice(p: Plan, at: int, pos: np.ndarray, rotvec: np.ndarray, opening: np.ndarray) -> Plan:
    """``p`` with rows inserted before row ``at``; times re-spaced at the controller's period."""
    P = np.concatenate([p.pos[:at], pos, p.pos[at:]])
    return Plan(np.arange(len(P)) * _DT, P, np.concatenate([p.rotvec[:at], rotvec, p.rotvec[at:]]),
                np.concatenate([p.opening[:at], opening, p.opening[at:]]), p.corrective)


def _min_jerk(n: int) -> np.ndarray:
    tau = np.arange(1, n + 1) / n
    return 10 * tau**3 - 15 * tau**4 + 6 * tau**5


def idle(p: Plan, rng: np.random.Generator) -> tuple[Plan, dict]:
    """The hand stops for 2.5-5 s (a 0.5 mm tremor only) at the start, before the grasp or mid-carry."""
    start, closed, release = _events(p)
    where = str(rng.choice(["start", "before_grasp", "carry"]))
    at = {"start": 1, "before_grasp": start, "carry": (closed + release) // 2}[where]
    n = int(round(rng.uniform(2.5, 5.0) * CONTROL_HZ))
    t = np.arange(n) * _DT
    shake = 0.0005 * np.sin(2 * np.pi * rng.uniform(1.5, 3.0) * t)[:, None] * rng.normal(size=3)
    out = _splice(p, at, p.pos[at] + shake, np.repeat(p.rotvec[at][None], n, 0), np.full(n, p.opening[at]))
    return out, {"where": where, "start_s": round(at * _DT, 3), "duration_s": round(n * _DT, 3)}


def _carry_progress(p: Plan, closed: int, release: int) -> np.ndarray:
    """(N,) 0 up to the grasp, then how far (0-1) the hand has come in (x, y) from the grasp to the release."""
    span = np.linalg.norm(p.pos[release, :2] - p.pos[closed, :2]) + 1e-9
    w = np.linalg.norm(p.pos[:, :2] - p.pos[closed, :2], axis=1) / span
    w[:closed] = 0.0
    w[release:] = 1.0
    return np.clip(w, 0.0, 1.0)


def wrong_target(p: Plan, rng: np.random.Generator) -> tuple[Plan, dict]:
    """The carry bends to a spot 8-12 cm from the pad, where the block is put down (off the pad)."""
    _, closed, release = _events(p)
    dist = rng.uniform(0.08, 0.12)  # beyond the pad's corner (sqrt(2) x PAD_HALF) in any direction
    a = rng.uniform(-np.pi, np.pi)
    off = dist * np.array([np.cos(a), np.sin(a)])
    pos = p.pos.copy()
    pos[:, :2] += _carry_progress(p, closed, release)[:, None] * off
    return dataclasses.replace(p, pos=pos), {"offset_m": [round(float(v), 4) for v in off]}


def dropped(p: Plan, rng: np.random.Generator) -> tuple[Plan, dict]:
    """The fingers open (0.3 s) once 20-55 % of the carry is done (the block falls short of the pad), and stay open."""
    _, closed, release = _events(p)
    at = int(np.flatnonzero(_carry_progress(p, closed, release) >= rng.uniform(0.2, 0.55))[0])
    opening = p.opening.copy()
    n = int(0.3 * CONTROL_HZ)
    opening[at:at + n] = _min_jerk(n)[: len(opening[at:at + n])] * MAX_OPENING_M
    opening[at + n:] = MAX_OPENING_M
    return dataclasses.replace(p, opening=opening), {"release_s": round(at * _DT, 3),
                                                     "height_m": round(float(p.pos[at, 2]), 4)}


def regrasp(p: Plan, rng: np.random.Generator) -> tuple[Plan, dict]:
    """After the fingers close: open, rise 3-5 cm, hover, come down 2-6 mm off and close again; 1-2 loops."""
    _, closed, _ = _events(p)
    base, rv = p.pos[closed], p.rotvec[closed]
    loops = int(rng.integers(1, 3))
    rows_pos, rows_open = [], []
    n_grip, n_move = int(0.3 * CONTROL_HZ), int(0.6 * CONTROL_HZ)
    for _ in range(loops):
        up = base + np.array([0.0, 0.0, rng.uniform(0.03, 0.05)])
        a = rng.uniform(-np.pi, np.pi)
        down = base + rng.uniform(0.002, 0.006) * np.array([np.cos(a), np.sin(a), 0.0])
        n_hover = int(rng.uniform(0.2, 0.5) * CONTROL_HZ)
        rows_pos += [np.repeat(base[None], n_grip, 0), base + _min_jerk(n_move)[:, None] * (up - base),
                     np.repeat(up[None], n_hover, 0), up + _min_jerk(n_move)[:, None] * (down - up),
                     np.repeat(down[None], n_grip, 0)]
        rows_open += [_min_jerk(n_grip) * MAX_OPENING_M, np.full(n_move + n_hover + n_move, MAX_OPENING_M),
                      (1 - _min_jerk(n_grip)) * MAX_OPENING_M]
        base = down
    pos = np.concatenate(rows_pos)
    # the rest of the track goes on from the first grasp's pose: a step of a few millimetres, held block and all
    out = _splice(p, closed + 1, pos, np.repeat(rv[None], len(pos), 0), np.concatenate(rows_open))
    return out, {"loops": loops, "start_s": round(closed * _DT, 3), "duration_s": round(len(pos) * _DT, 3)}


_PLAN_FAULTS = {"idle": idle, "wrong_target": wrong_target, "dropped": dropped, "regrasp": regrasp}


def _placed_kinds(bad_at: list[int], kinds: list[str]) -> tuple[dict[int, str], list[dict]]:
    """``{job index: kind}`` with every duplicate at a job that has an earlier good one to repeat, and the
    duplicates that could not be placed so (``[{"kind", "reason"}]``; their jobs stay good).

    Only the bad jobs before the first good one lack a source; a duplicate drawn there trades its kind
    with a later bad job's non-duplicate kind (no random draw: the other placements stay as drawn)."""
    kind_of = dict(zip(bad_at, kinds))
    first_good = next((i for i, j in enumerate(bad_at) if i != j), len(bad_at))
    later = [i for i in bad_at[first_good:] if kind_of[i] != "duplicate"]
    lost = []
    for i in bad_at[:first_good]:
        if kind_of[i] != "duplicate":
            continue
        if later:
            j = later.pop()
            kind_of[i], kind_of[j] = kind_of[j], kind_of[i]
        else:
            del kind_of[i]
            lost.append({"kind": "duplicate", "reason": f"job {i} has no earlier good episode to repeat "
                                                        "and no other bad job could take its place"})
    return kind_of, lost


def inject_faults(jobs: list[tuple[str, InitialState, Plan | None]], faults: FaultSpec,
                  ) -> tuple[list[tuple[str, InitialState, Plan | None]], dict]:
    """Make ``faults.bad_fraction`` of ``jobs`` bad demonstrations.

    The ``round(bad_fraction * len(jobs))`` bad jobs take the kinds in turn (``faults.kinds`` round
    robin, then shuffled), so every kind is written once there are at least as many bad jobs as kinds
    (5 of 25 at 0.2: one of each). A duplicate needs an earlier good episode to repeat: one drawn
    before the first good job trades its kind with a later bad job.

    Args:
        jobs: ``(stem, initial state, track or None)`` per episode, in recording order (None: the
            demonstrator's own track, :func:`~dpflow_core.sim.demonstrator.plan`).
        faults: how many, of which kinds.

    Returns:
        ``(jobs, truth)``: the jobs with the bad ones' states and tracks replaced, and the content of
        :data:`TRUTH_FILE` (``{"bad_fraction", "kinds", "seed", "written": {kind: count},
        "not_written": [{"kind", "reason"}], "episodes": [{stem, bad, kind, details}]}``). A duplicate
        copies an earlier good episode (``details.source``). ``not_written`` names every requested kind
        that has no episode (too few bad jobs, or no source for a duplicate); each also gives a
        :class:`UserWarning`.

    Raises:
        ValueError: ``faults`` is invalid (:meth:`FaultSpec.validate`).
    """
    faults.validate()
    rng = np.random.default_rng([0xBAD, faults.seed, len(jobs)])
    n_bad = int(round(faults.bad_fraction * len(jobs)))
    bad_at = sorted(int(i) for i in rng.choice(len(jobs), n_bad, replace=False))
    kinds = [faults.kinds[i % len(faults.kinds)] for i in range(n_bad)]
    rng.shuffle(kinds)
    kind_of, not_written = _placed_kinds(bad_at, kinds)
    out, truth = list(jobs), []
    for i, (stem, state, track) in enumerate(jobs):
        kind = kind_of.get(i)
        details: dict = {}
        if kind == "duplicate":
            src = int(rng.choice([j for j in range(i) if j not in kind_of]))
            src_stem, src_state, src_track = jobs[src]
            out[i] = (stem, dataclasses.replace(src_state, seed=state.seed), src_track or plan(src_state))
            details = {"source": src_stem}
        elif kind is not None:
            faulty, details = _PLAN_FAULTS[kind](track or plan(state), rng)
            out[i] = (stem, state, faulty)
        truth.append({"stem": stem, "bad": kind is not None, "kind": kind, "details": details})
    written = {k: sum(t["kind"] == k for t in truth) for k in dict.fromkeys(faults.kinds)}
    not_written += [{"kind": k, "reason": f"{n_bad} bad of {len(jobs)} episodes ({faults.bad_fraction:g}) "
                                          f"for {len(set(faults.kinds))} kinds"}
                    for k, n in written.items() if n == 0 and k not in {x["kind"] for x in not_written}]
    for miss in not_written:
        warnings.warn(f"fault kind {miss['kind']!r} not written: {miss['reason']}", stacklevel=2)
    return out, {"bad_fraction": faults.bad_fraction, "kinds": list(faults.kinds), "seed": faults.seed,
                 "written": written, "not_written": not_written, "episodes": truth}


def write_truth(task_dir: str | Path, truth: dict) -> Path:
    """Write ``truth`` (from :func:`inject_faults`) as :data:`TRUTH_FILE` in ``task_dir``."""
    return write_text_atomic(Path(task_dir) / TRUTH_FILE, json.dumps(truth, indent=2) + "\n")


def read_truth(task_dir: str | Path) -> dict:
    """The ground truth of a task folder recorded with faults.

    Raises:
        FileNotFoundError: the folder has no :data:`TRUTH_FILE` (it was recorded without faults).
        ValueError: the file is not valid JSON with an ``episodes`` list (names the file).
    """
    path = Path(task_dir) / TRUTH_FILE
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("episodes"), list):
        raise ValueError(f"{path}: not a curation truth file (needs an 'episodes' list)")
    return data
