"""The fault generator writes every kind asked for when the count allows, and says which it could not.

A trial asked for ``FaultSpec(bad_fraction=0.2)`` at 25 episodes (5 bad, 5 kinds) and got no duplicate:
the duplicate had been drawn for the first episode (nothing earlier to repeat) and turned into a second
idle one, silently."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest

from dpflow_core.sim.faults import KINDS, FaultSpec, inject_faults
from dpflow_core.sim.tasks import initial_state


def _jobs(n: int) -> list:
    return [(f"pick_place_{k:04d}", initial_state("pick_place", 7000 + k), None) for k in range(n)]


def _inject(n: int, spec: FaultSpec) -> tuple[dict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, truth = inject_faults(_jobs(n), spec)
    return truth, [str(w.message) for w in caught]


@pytest.mark.parametrize("n, fraction", [(25, 0.2), (10, 0.5), (40, 0.2)])
def test_every_kind_is_written_when_there_are_as_many_bad_episodes_as_kinds(n, fraction):
    truth, warned = _inject(n, FaultSpec(bad_fraction=fraction))
    n_bad = round(n * fraction)
    kinds = Counter(e["kind"] for e in truth["episodes"] if e["bad"])
    assert sum(kinds.values()) == n_bad
    # round robin: each kind n_bad // 5 or one more times
    assert {k: kinds[k] for k in KINDS} == truth["written"]
    assert all(n_bad // len(KINDS) <= kinds[k] <= -(-n_bad // len(KINDS)) for k in KINDS), kinds
    assert truth["not_written"] == [] and warned == []
    stems = [e["stem"] for e in truth["episodes"]]
    good = {e["stem"] for e in truth["episodes"] if not e["bad"]}
    for e in truth["episodes"]:
        if e["kind"] == "duplicate":  # repeats an earlier good episode
            assert e["details"]["source"] in good and stems.index(e["details"]["source"]) < stems.index(e["stem"])


def test_the_kinds_it_cannot_write_are_named():
    truth, warned = _inject(10, FaultSpec(bad_fraction=0.2))  # 2 bad episodes for 5 kinds
    missing = [m["kind"] for m in truth["not_written"]]
    assert sorted(missing) == sorted(k for k, n in truth["written"].items() if n == 0) and len(missing) == 3
    assert all("2 bad of 10 episodes" in m["reason"] for m in truth["not_written"])
    assert sorted(warned) == sorted(f"fault kind {k!r} not written: {m['reason']}"
                                    for k, m in zip(missing, truth["not_written"]))
    # every episode bad and every one a duplicate: none has an earlier good one to repeat
    truth, warned = _inject(3, FaultSpec(bad_fraction=1.0, kinds=("duplicate",)))
    assert not any(e["bad"] for e in truth["episodes"]) and truth["written"] == {"duplicate": 0}
    assert len(truth["not_written"]) == 3 and all("no earlier good episode" in m["reason"] for m in truth["not_written"])
    assert len(warned) == 3
