"""Shared fixtures."""

from __future__ import annotations

import os
import signal
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"

#: The test modules live in folders that mirror the packages (tests/core/runs/, tests/orchestration/, ...),
#: the helper modules here in tests/ (on ``sys.path`` through this conftest under pytest's default
#: ``prepend`` import mode). Some modules import shared pieces from a module of another folder by its
#: name (``from test_runs import FAKE_TRAINER`` in tests/core/test_checkpoints.py): pytest puts only each
#: collected module's own folder on ``sys.path``, so every folder of test modules is put there, last, and
#: such a module also runs alone. Test module names are unique across the folders (no ``__init__.py``).
for _folder in sorted({p.parent for p in TESTS.rglob("test_*.py")} - {TESTS}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

#: One intra-op thread for torch (OpenMP, MKL) in this process and every trainer the tests start. The
#: suite runs two pytest-xdist workers on a 2-core machine, each often beside a trainer subprocess:
#: with torch's default of one thread per core, their OpenMP threads spin-wait on each other, and a
#: tiny training measured here took 15x longer (6 steps: 56 s against 3.6 s, 27 s of CPU against 9 s).
#: Set before anything imports torch; trainers started over the test sshd get it through its
#: ``SetEnv`` (tests/sshd.py), Slurm jobs through sbatch's default ``--export=ALL``. What the tests
#: assert does not depend on the thread count (the bit-exact resume tests pinned it to 1 already).
TEST_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
for _name, _value in TEST_THREAD_ENV.items():
    os.environ.setdefault(_name, _value)

VENV_BIN = Path(sys.executable).parent

#: How to install each service a test may need (Debian 12), named in the skip or failure reason.
INSTALL = {
    "sshd": "apt-get install -y openssh-server",
    "postgresql": "apt-get install -y postgresql",
    "chromium": "apt-get install -y chromium && pip install -e '.[dev]' (playwright)",
    "docker compose": "apt-get install -y docker-compose",
    "tmux": "apt-get install -y tmux",
    "rsync": "apt-get install -y rsync",
    "slurm": "apt-get install -y slurm-wlm munge (the tests start their own cluster as root)",
    "netns": "apt-get install -y iproute2, and run the tests as root",
    "lerobot 0.4.4": "scripts/setup-lerobot.sh (makes .venv-lerobot-0.4)",
    "lerobot 0.3.3": "scripts/setup-lerobot.sh (makes .venv-lerobot-0.3)",
    "openpi-client": "scripts/setup-openpi-client.sh (makes .venv-openpi-client)",
}


def require_service(service: str, missing: str | None) -> None:
    """Stop a test that needs ``service`` when ``missing`` (why it cannot run) is not ``None``.

    Locally the test is skipped, with the install line in the reason. When the ``CI``
    environment variable is set (to anything but ``""``, ``0`` or ``false``) it fails instead:
    a CI run must not pass by skipping what it was meant to test.
    """
    if missing is None:
        return
    reason = f"{service} is not available: {missing} (install: {INSTALL[service]})"
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI is set, so a missing service fails the test instead of skipping it: {reason}", pytrace=False)
    pytest.skip(reason)


def missing_executable(name: str) -> str | None:
    """``None`` when ``name`` is on ``PATH``, else why not."""
    return None if shutil.which(name) else f"`{name}` is not on PATH"


@pytest.fixture(scope="session", autouse=True)
def _session_episode_cache(tmp_path_factory):
    """Module- and session-scoped fixtures that convert use a cache of the session, never the user's."""
    old = os.environ.get("DPFLOW_CACHE_DIR")
    os.environ["DPFLOW_CACHE_DIR"] = str(tmp_path_factory.mktemp("session-episode-cache"))
    yield
    if old is None:
        os.environ.pop("DPFLOW_CACHE_DIR", None)
    else:
        os.environ["DPFLOW_CACHE_DIR"] = old


def tmux_socket(stem: str) -> str:
    """A ``tmux -L`` socket name of this test process: ``dpflow-test-<stem>-<pid>``.

    Test modules name their tmux server with it so that two checkouts running the suite at the
    same time, or two pytest-xdist workers, never share (or kill) each other's server and sessions.
    """
    return f"dpflow-test-{stem}-{os.getpid()}"


def kill_tmux_server(socket: str) -> None:
    """Stop the tmux server ``socket`` started by this process's tests, locally or over the test sshd.

    A local server lives under this process's ``TMUX_TMPDIR`` (:func:`pytest_configure`); one started
    through the test sshd does not inherit it and lives under tmux's default folder.
    """
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)
    env = {k: v for k, v in os.environ.items() if k != "TMUX_TMPDIR"}
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True, env=env)


def pytest_configure(config):
    """Give this test process a tmux folder of its own (``TMUX_TMPDIR``).

    Every tmux server the tests start on this machine, the default one included (``dpflow demo``,
    ``dagster dev`` and the runs' sessions inherit the variable), then lives there: session names such
    as ``smoke-cpu`` cannot collide with another checkout's test run or an xdist worker's.
    """
    folder = tempfile.mkdtemp(prefix="dpflow-tmux-")
    config._dpflow_tmux_tmpdir = folder
    os.environ["TMUX_TMPDIR"] = folder


#: The modules that take longest, collected first and in this order (longest first, from the suite's
#: own per-module times, docs/benchmarks.md): under pytest-xdist (``--dist loadfile
#: --no-loadscope-reorder``, scripts/test.sh) each then starts early on a worker of its own, rather than
#: last while the other worker has nothing left to do. The rest keep their order. (Without
#: ``--no-loadscope-reorder`` xdist would sort the modules by their number of tests instead.)
SLOW_MODULES_FIRST = (
    "test_demo_e2e.py", "test_browser.py", "test_upstream_trainer.py", "test_multihost.py", "test_train_run.py",
    "test_pipes_ssh.py", "test_runs_trainer.py", "test_runs_cli.py", "test_slurm.py", "test_runs_ssh.py",
    "test_assets_training.py", "test_slurm_endings.py", "test_runs.py", "test_preflight.py", "test_upload.py",
    "test_run_monitoring.py", "test_multi_task.py", "test_gpu_expected.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_unconfigure(config):
    folder = getattr(config, "_dpflow_tmux_tmpdir", None)
    if folder is None:
        return
    for socket in Path(folder).glob("tmux-*/*"):  # servers a test left behind: stopped by their socket
        subprocess.run(["tmux", "-S", str(socket), "kill-server"], capture_output=True)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def _venv_on_path(monkeypatch, tmp_path_factory):
    """Subprocesses (dpflow, accelerate, dagster) resolve to this venv's scripts; each test has its
    own per-episode conversion cache (never the user's ~/.cache/dpflow)."""
    monkeypatch.setenv("PATH", f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("DPFLOW_CACHE_DIR", str(tmp_path_factory.mktemp("episode-cache")))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def train_in_process(dataset: Path, run_dir: Path, *overrides: str, config: str = "demo") -> Path:
    """Run the built-in trainer (``config``: a shipped config name) in this process; return ``latest.ckpt``."""
    from hydra import compose, initialize_config_dir

    from dpflow_core.train.app import CONFIG_DIR
    from dpflow_core.train.workspace import train

    with initialize_config_dir(config_dir=str(CONFIG_DIR)):
        cfg = compose(config, overrides=[f"task.dataset_path={dataset}", "logging.mode=disabled", *overrides])
    train(cfg, run_dir)
    return run_dir / "checkpoints" / "latest.ckpt"


class TinyCheckpoint(NamedTuple):
    """A real checkpoint of the built-in trainer and the dataset it was trained on."""

    dataset: Path  #: synthetic ``dataset.npz``: 4 episodes of 40 steps, 32x32 images, 10 Hz
    checkpoint: Path  #: ``latest.ckpt`` of the ``demo`` config after 1 epoch x 2 batches


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> TinyCheckpoint:
    """One trained tiny checkpoint per test process, shared by the modules that need a real checkpoint
    (its layout, its loading, its inference) but not a policy that learned anything. Read-only: a test
    that writes beside it must copy it first."""
    from synthetic_dataset import write_synthetic_dataset

    root = tmp_path_factory.mktemp("tiny-checkpoint")
    dataset = write_synthetic_dataset(root / "dataset.npz", n_episodes=4, episode_length=40, image_size=(32, 32))
    checkpoint = train_in_process(
        dataset, root / "run", "training.num_epochs=1", "training.max_train_steps=2", "training.max_val_steps=1")
    return TinyCheckpoint(dataset=dataset, checkpoint=checkpoint)


def _sigterm_state() -> str:
    """'' when SIGTERM is delivered with its default action in this process, else what is wrong with it."""
    if signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return "blocked"
    return "ignored" if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN else ""


def _restore_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _sigterm_stays_deliverable(request):
    """Every process a test starts inherits this worker's SIGTERM disposition and mask: once something leaves it
    ignored or blocked, every later `terminate()` of a child is a no-op, and the release, cleanup and serve tests
    time out far from the cause (seen in two full runs on 2026-12-05, never in those modules alone). Each test
    starts with SIGTERM deliverable; one that leaves it otherwise is named in a warning and the state restored."""
    before = _sigterm_state()
    if before:
        _restore_sigterm()
    yield
    after = _sigterm_state()
    if after:
        _restore_sigterm()
        import warnings

        warnings.warn(f"{request.node.nodeid} left SIGTERM {after} in the test process (restored)")
