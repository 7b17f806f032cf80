"""`dpflow` commands of the dataset stage."""

from __future__ import annotations

from dpflow_core.cli import app  # noqa: F401
