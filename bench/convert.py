"""Benchmark of the conversion to dataset.npz (not a test; figures go to docs/benchmarks.md).

Every comparison runs whole processes side by side, interleaved (A B A B ...), and reports the
median of the per-pair ratios, so a machine whose speed drifts (other jobs) still gives a fair
ratio. Wall time comes from the parent's clock, peak RSS from the kernel's accounting of the
finished child (``wait4`` ``ru_maxrss``: resident pages, anonymous and file-backed, of the
largest process of the tree that was waited for).

    python bench/convert.py prepare --out /tmp/dpflow-bench      # sample recordings, once
    python bench/convert.py run --out /tmp/dpflow-bench          # all comparisons, markdown tables
    python bench/convert.py run --out /tmp/dpflow-bench --only floor scaling

Sets (``dpflow_core.recordings.samples``, 30 Hz): ``e8`` 8 episodes of 8 s at 640x480 (the issue's
recordings), ``e32`` the same 8 recordings listed 4 times under other stems (32 episodes; the
bytes are identical, so writing them costs no extra minutes), ``native`` 2 episodes of 4 s at
1600x1300 (the DAS camera's size), ``long120`` one 120 s episode at 640x480, ``long1800`` one
1,800 s episode at 64x48, ``extra`` one more 640x480 episode for the incremental comparison.

The floor (``floor`` sub-command) is PyAV decoding plus swscale's area scaler to RGB in one pass,
one process, over the access units extracted beforehand (no MCAP parsing, no alignment, no
writing): the least any converter of these recordings has to do. It keeps one swscale context per
stream, as the converter does; ``--per-frame-scaler`` is the floor of the first measurements
(``VideoFrame.reformat``, a context per frame). The scaling table also runs N floors side by side
on the episodes dealt N ways: what N processes of pure decoding gain on this machine, the ceiling
for ``-j N``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DPFLOW = str(Path(sys.executable).parent / "dpflow")

SETS = {
    "e8": dict(n=8, seconds=8.0, width=640, height=480),
    "native": dict(n=2, seconds=4.0, width=1600, height=1300),
    "long120": dict(n=1, seconds=120.0, width=640, height=480),
    "long1800": dict(n=1, seconds=1800.0, width=64, height=48),
    "extra": dict(n=1, seconds=8.0, width=640, height=480, seed=100),
}


def _entry(path: Path) -> dict:
    h = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"path": str(path), "size_bytes": path.stat().st_size, "sha256": h}


def _manifest(episodes: list[tuple[str, Path, Path, Path]], root: Path) -> dict:
    from dpflow_core.recordings.topics import DAS_DEFAULT

    return {
        "manifest_version": 1, "root": str(root), "task": "bench", "created_at": "bench",
        "topics": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(DAS_DEFAULT).items()},
        "accepted": [{"stem": stem, "vio_status": {"status": "success"}, "validation": {},
                      "files": {"raw_mcap": _entry(raw), "vio_mcap": _entry(vio), "vio_json": _entry(js)}}
                     for stem, raw, vio, js in episodes],
        "rejected": [],
    }


def _extract_units(vio: Path, out: Path) -> None:
    """The camera access units of ``vio`` in capture order, length-prefixed, for the floor."""
    from dpflow_core.recordings import read_streams

    with open(out, "wb") as f:
        for data in read_streams(vio).camera_packets:
            f.write(len(data).to_bytes(4, "little"))
            f.write(data)


def prepare(out: Path) -> None:
    from dpflow_core.recordings import samples

    out.mkdir(parents=True, exist_ok=True)
    for name, s in SETS.items():
        manifest = out / f"{name}.json"
        if manifest.exists():
            continue
        root = out / name
        spec = replace(samples.SampleSpec(), width=s["width"], height=s["height"], seconds=s["seconds"])
        eps = []
        for k in range(s["n"]):
            started = time.perf_counter()
            e = samples.write_episode(root, f"{name}_{k:04d}", spec, seed=s.get("seed", 0) + k)
            _extract_units(e.vio_mcap, root / f"{e.stem}.units")
            eps.append((e.stem, e.raw_mcap, e.vio_mcap, e.vio_json))
            print(f"{name}: wrote {e.stem} in {time.perf_counter() - started:.1f} s", flush=True)
        manifest.write_text(json.dumps(_manifest(eps, root)))
        if name == "e8":
            copies = []
            for rep in range(4):
                for stem, raw, vio, js in eps:
                    copies.append((f"{stem}_r{rep}", raw, vio, js))
            (out / "e32.json").write_text(json.dumps(_manifest(copies, root)))


def floor(manifest: Path, size: tuple[int, int], per_frame_scaler: bool = False, part: tuple[int, int] = (0, 1)) -> None:
    """Child process: PyAV decode + swscale area resize to RGB in one pass, every episode in order.

    One swscale context per stream (``VideoReformatter``), the faster way; ``per_frame_scaler``
    uses ``VideoFrame.reformat`` instead (a new context per frame: the floor of the first
    measurements). ``part`` (k, n) takes every n-th episode from the k-th, for floors run side
    by side."""
    import av
    from av.video.reformatter import VideoReformatter

    from dpflow_core.conversion.decode import _SWS_FLAGS

    frames = 0
    kw = dict(width=size[0], height=size[1], format="rgb24", interpolation=_SWS_FLAGS)
    for e in json.loads(manifest.read_text())["accepted"][part[0]::part[1]]:
        vio = Path(e["files"]["vio_mcap"]["path"])
        data = (vio.parent / (vio.name.removesuffix("_vio.mcap") + ".units")).read_bytes()
        ctx = av.CodecContext.create("h264", "r")
        ctx.thread_count = 1
        scaler = VideoReformatter()
        scale = (lambda f: f.reformat(**kw)) if per_frame_scaler else (lambda f: scaler.reformat(f, **kw))
        at = 0
        while at < len(data):
            n = int.from_bytes(data[at:at + 4], "little")
            for f in ctx.decode(av.Packet(data[at + 4:at + 4 + n])):
                scale(f).to_ndarray()
                frames += 1
            at += 4 + n
        for f in ctx.decode(None):
            scale(f).to_ndarray()
            frames += 1
    print(json.dumps({"frames": frames}))


def _timed(cmd: list[str], env: dict | None = None) -> dict:
    """One whole process: wall seconds (parent clock), peak RSS MB and CPU seconds (``wait4``), its output."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {err.decode()[-2000:]}")
    return {"wall_s": wall, "rss_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
            "stdout": out.decode(), "stderr": err.decode()}


def _convert_cmd(manifest: Path, target: Path, size: str, workers: int, cache: bool = False,
                 exe: str = DPFLOW) -> list[str]:
    cmd = [exe, "convert", str(manifest), "-o", str(target), "--image-size", size, "-j", str(workers), "--json"]
    return cmd if cache else [*cmd, "--no-cache"]


def _arrays_sha256(path: Path) -> str:
    """SHA-256 over every member's array but the metadata (names sorted; shape, dtype and bytes): equal
    for two datasets with the same arrays whatever their zip layout. Computed in a child process
    after the timed run: numpy reads whole members into memory, and a child spawned later would
    start with this process's peak RSS as its own (exec keeps ``ru_maxrss``)."""
    return subprocess.run([sys.executable, __file__, "arrays-digest", str(path)], capture_output=True, text=True,
                          check=True).stdout.strip()


def arrays_digest(path: Path) -> None:
    import numpy as np

    digest = hashlib.sha256()
    with np.load(path) as z:
        for name in sorted(n for n in z.files if n != "meta__info_json"):
            a = z[name]
            digest.update(f"{name}{a.shape}{a.dtype}".encode())
            digest.update(np.ascontiguousarray(a).tobytes())
    print(digest.hexdigest())


def _cleanup(target: Path) -> None:
    for p in (target, target.with_suffix(".json"), target.with_name(f"{target.stem}.norm_stats.json"),
              target.with_name("norm_stats.json")):
        p.unlink(missing_ok=True)


def interleaved(commands: dict[str, callable], rounds: int) -> dict[str, list[dict]]:
    """Run each command once per round, in turn (A B C A B C ...); every run's figures by name."""
    runs: dict[str, list[dict]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, make in commands.items():
            runs[name].append(make())
    return runs


def _median(values) -> float:
    return statistics.median(values)


def _ratio(runs: dict, a: str, b: str, key: str = "wall_s") -> tuple[float, float, float]:
    r = [x[key] / y[key] for x, y in zip(runs[a], runs[b])]
    return min(r), _median(r), max(r)


def _conversion(out: Path, manifest: Path, size: str, workers: int, tag: str, cache: bool = False,
                env: dict | None = None, exe: str = DPFLOW) -> callable:
    def run() -> dict:
        target = out / f"bench-{tag}-{os.getpid()}.npz"
        _cleanup(target)
        r = _timed(_convert_cmd(manifest, target, size, workers, cache, exe), env=env)
        meta = json.loads(target.with_suffix(".json").read_text())
        r.update(frames=meta["total_steps"], timings=meta["timings_s"], workers=meta["workers"],
                 worker_rss_mb=max(e["worker_peak_rss_mb"] for e in meta["episodes"]), sha256=meta["sha256"],
                 arrays_sha256=_arrays_sha256(target))
        _cleanup(target)
        return r
    return run


def _floor(manifest: Path, size: str, per_frame_scaler: bool = False) -> callable:
    def run() -> dict:
        r = _timed([sys.executable, __file__, "floor", str(manifest), "--image-size", size,
                    *(["--per-frame-scaler"] if per_frame_scaler else [])])
        r["frames"] = json.loads(r["stdout"].strip().splitlines()[-1])["frames"]
        return r
    return run


def _floors_side_by_side(manifest: Path, size: str, n: int) -> callable:
    """``n`` floor processes started at once, each on every n-th episode: the machine's own
    scaling ceiling for ``-j n`` (wall time until the last one ends)."""
    def run() -> dict:
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, __file__, "floor", str(manifest), "--image-size", size,
                                   "--part", f"{k}/{n}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for k in range(n)]
        frames = 0
        for p in procs:
            out, err = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"floor part exited {p.returncode}: {err.decode()[-2000:]}")
            frames += json.loads(out.decode().strip().splitlines()[-1])["frames"]
        return {"wall_s": time.perf_counter() - started, "frames": frames}
    return run


def _fmt(lo_med_hi: tuple[float, float, float]) -> str:
    lo, med, hi = lo_med_hi
    return f"{med:.2f} ({lo:.2f}-{hi:.2f})"


def bench_floor(out: Path, rounds: int, size: str, sets: list[str], baseline: str | None = None) -> None:
    print(f"\n### dpflow convert -j 1 against the decode + resize floor ({size})\n")
    print(f"load average before the runs: {os.getloadavg()[0]:.1f}\n")
    print("| set | frames | convert wall s | floor wall s | floor / convert (speed, x floor) "
          "| convert CPU s | floor CPU s | floor / convert, CPU | floor with a scaler per frame: wall s, CPU s "
          "| convert peak RSS MB | align / write / norm stats s |"
          + (" before: convert wall s, CPU s | convert / before: wall, CPU | same SHA-256 | same arrays |"
             if baseline else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if baseline else ""))
    for name in sets:
        manifest = out / f"{name}.json"
        s = size
        commands = {"convert": _conversion(out, manifest, s, 1, name), "floor": _floor(manifest, s),
                    "floor_per_frame": _floor(manifest, s, per_frame_scaler=True)}
        if baseline:
            commands["before"] = _conversion(out, manifest, s, 1, f"{name}-before", exe=baseline)
        runs = interleaved(commands, rounds)
        conv, fl, old = runs["convert"], runs["floor"], runs["floor_per_frame"]
        assert conv[0]["frames"] == fl[0]["frames"] == old[0]["frames"], (conv[0]["frames"], fl[0]["frames"])
        t = conv[len(conv) // 2]["timings"]
        print(f"| {name} | {conv[0]['frames']} | {_median(r['wall_s'] for r in conv):.2f} | "
              f"{_median(r['wall_s'] for r in fl):.2f} | {_fmt(_ratio(runs, 'floor', 'convert'))} | "
              f"{_median(r['cpu_s'] for r in conv):.2f} | {_median(r['cpu_s'] for r in fl):.2f} | "
              f"{_fmt(_ratio(runs, 'floor', 'convert', 'cpu_s'))} | "
              f"{_median(r['wall_s'] for r in old):.2f}, {_median(r['cpu_s'] for r in old):.2f} | "
              f"{_median(r['rss_mb'] for r in conv):.0f} | {t['episodes']:.2f} / {t['write']:.2f} / {t['norm_stats']:.2f} |"
              + (f" {_median(r['wall_s'] for r in runs['before']):.2f}, {_median(r['cpu_s'] for r in runs['before']):.2f} | "
                 f"{_fmt(_ratio(runs, 'convert', 'before'))}, {_fmt(_ratio(runs, 'convert', 'before', 'cpu_s'))} | "
                 f"{'yes' if {r['sha256'] for r in conv} == {r['sha256'] for r in runs['before']} else 'no'} | "
                 f"{'yes' if {r['arrays_sha256'] for r in conv} == {r['arrays_sha256'] for r in runs['before']} else 'NO'} |"
                 if baseline else ""),
              flush=True)


def bench_scaling(out: Path, rounds: int, baseline: str | None = None) -> None:
    print("\n### Scaling: -j N against -j 1 (32 episodes, 640x480 -> 224x224)\n")
    cores = len(os.sched_getaffinity(0))
    ns = [1, 2] + ([4] if cores >= 4 else [])
    manifest = out / "e32.json"
    commands = {f"j{n}": _conversion(out, manifest, "224,224", n, f"j{n}") for n in ns}
    commands.update({f"floor{n}": _floors_side_by_side(manifest, "224,224", n) for n in ns})
    if baseline:
        commands.update({f"before{n}": _conversion(out, manifest, "224,224", n, f"before{n}", exe=baseline) for n in ns})
    load_before = os.getloadavg()[0]
    runs = interleaved(commands, rounds)
    print(f"cores: {cores}; load average before the runs: {load_before:.1f}, after: {os.getloadavg()[0]:.1f}\n")
    print("| workers | wall s (median) | time / time of -j 1 | speed-up | CPU s (converting process; -j N>1: without workers) | parent peak RSS MB "
          "| worker peak RSS MB | align / write phase s | n floors side by side: wall s | their time / one floor's |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in ns:
        rr = _ratio(runs, f"j{n}", "j1")
        fr = _ratio(runs, f"floor{n}", "floor1")
        print(f"| {n} | {_median(r['wall_s'] for r in runs[f'j{n}']):.2f} | {_fmt(rr)} | {1 / rr[1]:.2f} | "
              f"{_median(r['cpu_s'] for r in runs[f'j{n}']):.2f} | "
              f"{_median(r['rss_mb'] for r in runs[f'j{n}']):.0f} | "
              f"{_median(r['worker_rss_mb'] for r in runs[f'j{n}']):.0f} | "
              f"{_median(r['timings']['episodes'] for r in runs[f'j{n}']):.2f} / "
              f"{_median(r['timings']['write'] for r in runs[f'j{n}']):.2f} | "
              f"{_median(r['wall_s'] for r in runs[f'floor{n}']):.2f} | {_fmt(fr)} |", flush=True)
    shas = {r["sha256"] for n in ns for r in runs[f"j{n}"]}
    print(f"\ndataset SHA-256 of every -j N run: {'one and the same' if len(shas) == 1 else f'{len(shas)} different'}")
    if baseline:
        same = {r["arrays_sha256"] for n in ns for r in runs[f"j{n}"] + runs[f"before{n}"]}
        print(f"arrays of every run, this code and before: {'the same' if len(same) == 1 else 'DIFFERENT'}")
        print("\nbefore (the --baseline executable), same runs interleaved:\n")
        print("| workers | wall s (median) | time / time of -j 1 | write phase s | this code's time / before's |")
        print("|---|---|---|---|---|")
        for n in ns:
            print(f"| {n} | {_median(r['wall_s'] for r in runs[f'before{n}']):.2f} | "
                  f"{_fmt(_ratio(runs, f'before{n}', 'before1'))} | "
                  f"{_median(r['timings']['write'] for r in runs[f'before{n}']):.2f} | "
                  f"{_fmt(_ratio(runs, f'j{n}', f'before{n}'))} |", flush=True)


def bench_memory(out: Path, rounds: int, baseline: str | None, sets: list[str], baseline_sets: list[str]) -> None:
    print("\n### Peak RSS (file-backed pages included) of dpflow convert -j 1\n")
    print("| set | output size | frames | peak RSS MB | wall s |" + (" baseline peak RSS MB |" if baseline else ""))
    print("|---|---|---|---|---|" + ("---|" if baseline else ""))
    for name in sets:
        size = "64,48" if name == "long1800" else "224,224"
        manifest = out / f"{name}.json"
        commands = {"convert": _conversion(out, manifest, size, 1, f"mem-{name}")}
        if baseline and name in baseline_sets:
            def base(manifest=manifest, size=size, name=name) -> dict:
                target = out / f"bench-base-{name}.npz"
                _cleanup(target)
                cmd = [baseline, "convert", str(manifest), "-o", str(target), "--image-size", size, "-j", "1"]
                r = _timed(cmd)
                _cleanup(target)
                return r
            commands["baseline"] = base
        runs = interleaved(commands, rounds)
        conv = runs["convert"]
        row = (f"| {name} | {size.replace(',', 'x')} | {conv[0]['frames']} | {max(r['rss_mb'] for r in conv):.0f} | "
               f"{_median(r['wall_s'] for r in conv):.1f} |")
        if baseline:
            row += f" {max(r['rss_mb'] for r in runs['baseline']):.0f} |" if "baseline" in runs else " - |"
        print(row, flush=True)


def bench_incremental(out: Path, rounds: int) -> None:
    """33 = e32 + extra: convert e32 into a fresh cache, then time e32+extra (1 episode to align)
    against converting the extra episode alone plus the write phase of the 33."""
    print("\n### Incremental: one episode added to a converted 32-episode task\n")
    both = json.loads((out / "e32.json").read_text())
    both["accepted"] += json.loads((out / "extra.json").read_text())["accepted"]
    m33 = out / "e33.json"
    m33.write_text(json.dumps(both))
    rows = []
    for k in range(rounds):
        cache = out / f"cache-{os.getpid()}-{k}"
        shutil.rmtree(cache, ignore_errors=True)
        env = {**os.environ, "DPFLOW_CACHE_DIR": str(cache)}
        first = _conversion(out, out / "e32.json", "224,224", 1, "inc32", cache=True, env=env)()
        inc = _conversion(out, m33, "224,224", 1, "inc33", cache=True, env=env)()
        one = _conversion(out, out / "extra.json", "224,224", 1, "one")()
        full = _conversion(out, m33, "224,224", 1, "full33")()
        assert inc["sha256"] == full["sha256"], "incremental and full conversions differ"
        rows.append((first, inc, one, full))
        shutil.rmtree(cache, ignore_errors=True)
    print("| run | 32 into an empty cache s | 33 with 32 cached s | the new episode alone s | write phase of 33 s "
          "| incremental / (alone + write) | full 33, no cache s | same SHA-256 |")
    print("|---|---|---|---|---|---|---|---|")
    for k, (first, inc, one, full) in enumerate(rows):
        w = inc["timings"]["write"]
        print(f"| {k + 1} | {first['wall_s']:.1f} | {inc['wall_s']:.1f} | {one['wall_s']:.1f} | {w:.1f} | "
              f"{inc['wall_s'] / (one['wall_s'] + w):.2f} | {full['wall_s']:.1f} | yes |", flush=True)


def bench_startup(rounds: int, baseline: str | None) -> None:
    print("\n### Start-up of commands that need no heavy module\n")
    cmds = {"dpflow --version": [DPFLOW, "--version"], "dpflow --help": [DPFLOW, "--help"],
            "dpflow cache show": [DPFLOW, "cache", "show"], "python -c pass": [sys.executable, "-c", "pass"]}
    if baseline:
        cmds["baseline dpflow --version"] = [baseline, "--version"]
        cmds["baseline dpflow --help"] = [baseline, "--help"]
    runs = interleaved({k: (lambda c=c: _timed(c)) for k, c in cmds.items()}, rounds)
    print("| command | wall s (median) | CPU s (median) | wall / wall of python -c pass |")
    print("|---|---|---|---|")
    for k in cmds:
        print(f"| {k} | {_median(r['wall_s'] for r in runs[k]):.3f} | {_median(r['cpu_s'] for r in runs[k]):.3f} | "
              f"{_fmt(_ratio(runs, k, 'python -c pass'))} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--out", type=Path, default=Path("/tmp/dpflow-bench"))
    pr = sub.add_parser("run")
    pr.add_argument("--out", type=Path, default=Path("/tmp/dpflow-bench"))
    pr.add_argument("--rounds", type=int, default=3)
    pr.add_argument("--only", nargs="*", default=["startup", "floor", "scaling", "memory", "incremental"])
    pr.add_argument("--baseline", help="Another dpflow executable (e.g. an older checkout's), run beside this one.")
    pr.add_argument("--incremental-rounds", type=int, default=1)
    pr.add_argument("--scaling-rounds", type=int, default=2)
    pr.add_argument("--floor-sets", nargs="*", default=["e8", "e32", "native"])
    pr.add_argument("--memory-sets", nargs="*", default=["e8", "e32", "long120", "long1800"])
    pr.add_argument("--baseline-sets", nargs="*", default=["long120"], help="Memory sets also run with --baseline.")
    pf = sub.add_parser("floor")
    pf.add_argument("manifest", type=Path)
    pf.add_argument("--image-size", default="224,224")
    pf.add_argument("--per-frame-scaler", action="store_true", help="VideoFrame.reformat: a new swscale context per frame.")
    pf.add_argument("--part", default="0/1", help="k/n: every n-th episode from the k-th.")
    pa = sub.add_parser("arrays-digest")
    pa.add_argument("path", type=Path)
    args = p.parse_args()
    if args.cmd == "prepare":
        prepare(args.out)
    elif args.cmd == "arrays-digest":
        arrays_digest(args.path)
    elif args.cmd == "floor":
        floor(args.manifest, tuple(int(v) for v in args.image_size.split(",")), args.per_frame_scaler,
              tuple(int(v) for v in args.part.split("/")))
    else:
        print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; rounds {args.rounds}")
        for what in args.only:
            if what == "startup":
                bench_startup(max(args.rounds, 5), args.baseline)
            elif what == "floor":
                bench_floor(args.out, args.rounds, "224,224", args.floor_sets, args.baseline)
            elif what == "scaling":
                bench_scaling(args.out, args.scaling_rounds, args.baseline)
            elif what == "memory":
                bench_memory(args.out, 1, args.baseline, args.memory_sets, args.baseline_sets)
            elif what == "incremental":
                bench_incremental(args.out, args.incremental_rounds)
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
