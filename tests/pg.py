"""A private PostgreSQL server for tests, started for real on 127.0.0.1.

Debian's PostgreSQL binaries (``/usr/lib/postgresql/<version>/bin``) create a
throw-away cluster in a temporary folder (``initdb`` as the ``postgres`` user when
the tests run as root, since PostgreSQL refuses to run as root), listen on a
free loopback port with the Unix socket in the same folder, and are stopped by
``pg_ctl -m fast stop`` (falling back to SIGTERM to the postmaster PID read from
``postmaster.pid``). ``.ci/run`` installs the ``postgresql`` package when absent;
without it the fixture skips with that reason (fails when ``CI`` is set).

The cluster uses password authentication (scram-sha-256) so the Dagster
configuration is exercised with the same environment variables as a deployment:
``DAGSTER_PG_HOST``, ``DAGSTER_PG_PORT``, ``DAGSTER_PG_USERNAME``,
``DAGSTER_PG_PASSWORD``, ``DAGSTER_PG_DB``.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from glob import glob
from pathlib import Path

import pytest
from conftest import require_service


@dataclass
class PgServer:
    """A running private cluster.

    Attributes:
        host, port: where it listens (TCP, loopback only).
        user, password: the superuser created by ``initdb``.
        db: a database created for the test (empty).
        base: the temporary folder holding ``data/`` and the Unix socket.
        pid: the postmaster's PID.
    """

    host: str
    port: int
    user: str
    password: str
    db: str
    base: Path
    pid: int
    bin_dir: Path

    @property
    def data_dir(self) -> Path:
        return self.base / "data"

    @property
    def env(self) -> dict[str, str]:
        """The ``DAGSTER_PG_*`` variables read by ``dagster_home/dagster.postgres.yaml``."""
        return {
            "DAGSTER_PG_HOST": self.host,
            "DAGSTER_PG_PORT": str(self.port),
            "DAGSTER_PG_USERNAME": self.user,
            "DAGSTER_PG_PASSWORD": self.password,
            "DAGSTER_PG_DB": self.db,
        }

    def connect(self, db: str | None = None):
        """A psycopg2 connection (autocommit) over TCP with the password; close it after use."""
        import psycopg2

        conn = psycopg2.connect(host=self.host, port=self.port, user=self.user, password=self.password, dbname=db or self.db)
        conn.autocommit = True
        return conn

    def query(self, sql: str, args: tuple = (), db: str | None = None) -> list[tuple]:
        """Run one statement and return its rows (empty for statements without a result)."""
        conn = self.connect(db)
        try:
            with conn.cursor() as cur:
                cur.execute(sql, args)
                return cur.fetchall() if cur.description else []
        finally:
            conn.close()

    def create_database(self, name: str) -> str:
        """Create an empty database ``name`` (letters, digits, underscore) and return its name."""
        if not name.replace("_", "").isalnum():
            raise ValueError(f"database name {name!r}: use letters, digits and underscores")
        self.query(f'CREATE DATABASE "{name}"', db="postgres")
        return name


def find_bin_dir() -> Path | None:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding ``initdb`` (``None`` if absent)."""
    found = sorted(glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_cluster_owner(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run as the ``postgres`` user then."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


def start_postgres(db: str = "dagster") -> PgServer:
    """Create and start a private cluster; see the module docstring.

    Raises:
        RuntimeError: ``initdb`` or ``pg_ctl start`` failed (their output is in
            the message, with the server log).
    """
    bin_dir = find_bin_dir()
    if bin_dir is None:
        raise RuntimeError("PostgreSQL binaries not found (apt-get install postgresql)")
    base = Path(tempfile.mkdtemp(prefix="dpflow-pg-"))
    base.chmod(0o755)  # the cluster owner must reach the socket folder inside
    data = base / "data"
    password = secrets.token_hex(12)
    pwfile = base / "pwfile"
    pwfile.write_text(password + "\n")
    if os.geteuid() == 0:
        owner = pwd.getpwnam("postgres")
        os.chown(base, owner.pw_uid, owner.pw_gid)
        os.chown(pwfile, owner.pw_uid, owner.pw_gid)
    user = "dpflow"
    init = subprocess.run(
        _as_cluster_owner([
            str(bin_dir / "initdb"), "-D", str(data), "-U", user, f"--pwfile={pwfile}",
            "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync",
        ]),
        capture_output=True, text=True,
    )
    pwfile.unlink()
    if init.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"initdb failed ({init.returncode}): {init.stdout}{init.stderr}")
    port = _free_port()
    log = base / "server.log"
    opts = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=50"
    start = subprocess.run(
        _as_cluster_owner([str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", opts, "-w", "-t", "60", "start"]),
        capture_output=True, text=True,
    )
    if start.returncode != 0:
        server_log = log.read_text() if log.exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"pg_ctl start failed ({start.returncode}): {start.stdout}{start.stderr}\n{server_log}")
    pid = int((data / "postmaster.pid").read_text().split("\n", 1)[0])
    server = PgServer(host="127.0.0.1", port=port, user=user, password=password, db=db, base=base, pid=pid, bin_dir=bin_dir)
    try:
        server.create_database(db)
    except Exception:
        stop_postgres(server)
        raise
    return server


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_postgres(server: PgServer) -> None:
    """Stop the cluster (``pg_ctl -m fast stop``; SIGTERM to its PID if that fails) and delete it."""
    subprocess.run(
        _as_cluster_owner([str(server.bin_dir / "pg_ctl"), "-D", str(server.data_dir), "-m", "fast", "-w", "-t", "30", "stop"]),
        capture_output=True, text=True,
    )
    if _alive(server.pid):
        os.kill(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while _alive(server.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    shutil.rmtree(server.base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    """A running private PostgreSQL server for the session (skips, or fails under CI, when PostgreSQL is not installed)."""
    if find_bin_dir() is None:
        require_service("postgresql", "no initdb under /usr/lib/postgresql/*/bin or on PATH")
    server = start_postgres()
    try:
        yield server
    finally:
        stop_postgres(server)
