"""Serving an ``.rrd`` with Rerun's own web viewer, on loopback only.

``rr.serve_web_viewer`` and ``rr.serve_grpc`` of rerun-sdk 0.41 take no bind address and listen
on every interface (0.0.0.0, seen with ``ss -ltn``), and a ``GrpcServerSink`` can be bound but the
web viewer's HTTP server cannot. The ``rerun`` executable shipped in the same wheel (package
``rerun_cli``) binds both where ``--bind`` says, so this module runs it::

    rerun --serve-web --bind 127.0.0.1 --port GRPC --web-viewer-port WEB FILE.rrd

It loads the file into its gRPC server (the buffer is sized to hold the whole file, so a late
browser sees all of it) and hosts the viewer at ``http://127.0.0.1:WEB``; the page is opened with
``?url=rerun+http://127.0.0.1:GRPC/proxy``. The process is ours, recorded by PID, and stopped by
that PID (TERM, then KILL only if TERM did not end it).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from dpflow_core.view.rrd import ViewError

LOOPBACK = "127.0.0.1"


def rerun_executable() -> Path:
    """The ``rerun`` binary of the installed rerun-sdk wheel.

    Raises:
        ViewError: the wheel carries no executable (a build without the CLI).
    """
    import rerun_cli

    exe = Path(rerun_cli.__file__).parent / "rerun"
    if not exe.is_file():
        raise ViewError("rerun-sdk's wheel has no `rerun` executable; the web viewer cannot be served", exe,
                        code="no_viewer")
    return exe


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


@dataclass
class ViewerServer:
    """A running web viewer: ``url`` opens the recording; ``pid`` is the ``rerun`` process."""

    url: str
    web_port: int
    grpc_port: int
    pid: int
    proc: subprocess.Popen

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """Stop the server by its PID: TERM, then KILL after ``timeout_s``; returns its exit status."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)
        return self.proc.returncode


def serve_rrd(path: str | Path | list, web_port: int = 0, grpc_port: int = 0, timeout_s: float = 30.0,
              log: str | Path | None = None) -> ViewerServer:
    """Serve ``path`` with Rerun's web viewer on 127.0.0.1 and wait until the page answers.

    Args:
        path: the ``.rrd``, or a list of them (the viewer lists each recording).
        web_port, grpc_port: TCP ports on 127.0.0.1 (0: a free one).
        timeout_s: how long to wait for the viewer's HTTP server.
        log: a file for the server's output (default: discarded).

    Raises:
        ViewError: the file is missing, or the server exited or did not answer in ``timeout_s``
            (the server is stopped then).
    """
    import urllib.request

    paths = [Path(p) for p in (path if isinstance(path, list) else [path])]
    for p in paths:
        if not p.is_file():
            raise ViewError("not found", p, code="missing_file")
    path = paths[0]
    web_port, grpc_port = web_port or _free_port(), grpc_port or _free_port()
    # The gRPC server drops its oldest data beyond its memory limit: give it room for the whole files.
    limit_gib = max(1, -(-sum(p.stat().st_size for p in paths) * 2 // (1 << 30)))
    cmd = [str(rerun_executable()), "--serve-web", "--bind", LOOPBACK, "--port", str(grpc_port),
           "--web-viewer-port", str(web_port), "--server-memory-limit", f"{limit_gib}GiB", *map(str, paths)]
    out = open(log, "ab") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None:
            out.close()
    proxy = f"rerun+http://{LOOPBACK}:{grpc_port}/proxy"
    server = ViewerServer(f"http://{LOOPBACK}:{web_port}/?url={urllib.parse.quote(proxy, safe='')}",
                          web_port, grpc_port, proc.pid, proc)
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ViewError(f"the web viewer exited with status {proc.returncode}: {' '.join(cmd)}", path,
                            code="viewer_failed")
        try:
            with urllib.request.urlopen(f"http://{LOOPBACK}:{web_port}/", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise ViewError(f"the web viewer did not answer on port {web_port} within {timeout_s:g} s", path,
                            code="viewer_failed")
        time.sleep(0.2)
