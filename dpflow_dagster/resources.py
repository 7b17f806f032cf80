"""Dagster resources, chosen by configuration (never by ``if`` inside assets)."""

from __future__ import annotations

from typing import Any


def default_resources() -> dict[str, Any]:
    """Resources of the embedded default (local GPU-server transport)."""
    return {}
