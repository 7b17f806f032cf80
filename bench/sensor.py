"""Benchmark of the recordings sensor (not a test; results go to docs/benchmarks.md).

Times ticks of ``recordings_sensor`` over an output root of N finished recordings spread
over task folders, for this checkout's sensor and for the sensor of another git revision
(default ``main``, loaded from ``git show REV:dpflow_dagster/sensors.py``), each in a fresh
process, taking turns round after round, so that the load other jobs put on the machine
falls on both alike:

- first tick (every recording seen for the first time), second tick (all requested);
- a quiet tick: nothing changed (median of ``--quiet-ticks``), with the audit at its
  default budget and with the audit off (``DPFLOW_SENSOR_AUDIT_FILES=0``: the folder-mtime
  path alone);
- a tick with the audit by age alone (``DPFLOW_SENSOR_AUDIT_FILES=0``, ``DPFLOW_SENSOR_AUDIT_S=0``):
  one whole folder scanned, the cost of that audit for folders larger than its budget;
- the cursor's size after the first and after the quiet ticks, and the characters
  logged by the tick that requests every recording.

The recordings are empty ``.mcap`` / ``_vio.mcap`` files and a ``{"status": "success"}``
``_vio.json`` (the sensor only stats the MCAPs), with old mtimes, as a settled archive.

Usage::

    .venv/bin/python bench/sensor.py --recordings 10000 30000 --folders 20 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OLD_NS = 1_700_000_000 * 1_000_000_000


def make_root(root: Path, recordings: int, folders: int) -> Path:
    """``root/task_XX/rec_YYYYYY{.mcap,_vio.mcap,_vio.json}``, old mtimes; reused when complete."""
    done = root / ".complete"
    if done.exists():
        return root
    status = json.dumps({"status": "success"}).encode()
    for i in range(recordings):
        folder = root / f"task_{i % folders:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        stem = folder / f"rec_{i:06d}"
        for suffix, data in ((".mcap", b""), ("_vio.mcap", b""), ("_vio.json", status)):
            p = stem.with_name(stem.name + suffix)
            p.write_bytes(data)
            t = OLD_NS + i * 1_000_000
            os.utime(p, ns=(t, t))
    for folder in root.iterdir():
        os.utime(folder, ns=(OLD_NS, OLD_NS))
    done.write_text("")
    return root


def _load_sensor(rev: str):
    if rev == "worktree":
        from dpflow_dagster import sensors

        return sensors
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:dpflow_dagster/sensors.py"], capture_output=True, text=True, check=True
    ).stdout
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"dpflow_bench_sensors_{rev.replace('/', '_')}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"sensors_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Log:
    def __init__(self):
        self.lines: list[str] = []

    def info(self, msg):
        self.lines.append(msg)

    debug = warning = error = info


def measure(rev: str, root: str, quiet_ticks: int) -> dict:
    """In a fresh process: tick times of one sensor over ``root``."""
    import dagster as dg

    os.environ["DPFLOW_RECORDINGS_ROOT"] = root
    sensors = _load_sensor(rev)
    out = {}
    with dg.instance_for_test() as instance:

        def tick(cursor, audit=None, audit_s=None):
            for name, value in (("DPFLOW_SENSOR_AUDIT_FILES", audit), ("DPFLOW_SENSOR_AUDIT_S", audit_s)):
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = str(value)
            context = dg.build_sensor_context(instance=instance, cursor=cursor)
            log = _Log()
            context._logger = log  # what context.log returns (Dagster 1.13): the lines are counted, not written
            t0 = time.perf_counter()
            result = sensors.recordings_sensor(context)
            return result, time.perf_counter() - t0, log.lines

        first, out["first_s"], _ = tick(None)
        out["first_cursor_bytes"] = len(first.cursor or "")
        second, out["second_s"], lines = tick(first.cursor)
        out["requests"] = len(second.run_requests)
        out["second_log_chars"] = sum(len(x) for x in lines)
        cursor = second.cursor
        for key, audit in (("quiet_s", None), ("quiet_no_audit_s", 0)):
            times = []
            for _ in range(quiet_ticks):
                result, dt, lines = tick(cursor, audit)
                cursor = result.cursor
                times.append(dt)
            out[key] = statistics.median(times)
            out[key.replace("_s", "_log_lines")] = len(lines)
        out["cursor_bytes"] = len(cursor or "")
        # the audit by age alone: one folder (the least recently scanned) fully scanned
        _, out["age_audit_s"], _ = tick(cursor, 0, 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/dpflow-bench-sensor"))
    parser.add_argument("--recordings", type=int, nargs="+", default=[10000, 30000])
    parser.add_argument("--folders", type=int, default=20)
    parser.add_argument("--baseline", default="main", help="git revision of the sensor to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quiet-ticks", type=int, default=5)
    parser.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.quiet_ticks)))
        return

    roots = {}
    for n in args.recordings:
        t0 = time.perf_counter()
        roots[n] = make_root(args.workdir / f"root_{n}_{args.folders}", n, args.folders)
        print(f"root of {n} recordings ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    revs = ["worktree", args.baseline]
    results: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.rounds):
        for n, root in roots.items():
            for rev in revs:
                out = subprocess.run(
                    [sys.executable, __file__, "--quiet-ticks", str(args.quiet_ticks), "--measure", rev, str(root)],
                    capture_output=True, text=True, check=True, cwd=REPO,
                ).stdout
                r = json.loads(out.strip().splitlines()[-1])
                results.setdefault((n, rev), []).append(r)
                print(f"{n} {rev}: {r}", file=sys.stderr)

    def med(n, rev, key):
        return statistics.median(r[key] for r in results[(n, rev)])

    print(
        f"| recordings ({args.folders} task folders) | sensor | first tick s | second tick s (requests) | "
        "quiet tick s | quiet tick s, audit off | quiet x baseline | tick with one folder audited by age s | "
        "cursor bytes after first / quiet tick | log chars, requesting tick |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in roots:
        for rev in revs:
            label = "this branch" if rev == "worktree" else args.baseline
            print(
                f"| {n} | {label} | {med(n, rev, 'first_s'):.3f} | {med(n, rev, 'second_s'):.3f} | "
                f"{med(n, rev, 'quiet_s'):.4f} | {med(n, rev, 'quiet_no_audit_s'):.4f} | "
                f"{med(n, rev, 'quiet_s') / med(n, args.baseline, 'quiet_s'):.3f} | "
                f"{med(n, rev, 'age_audit_s'):.3f} | {med(n, rev, 'first_cursor_bytes'):.0f} / "
                f"{med(n, rev, 'cursor_bytes'):.0f} | {med(n, rev, 'second_log_chars'):.0f} |"
            )


if __name__ == "__main__":
    main()
