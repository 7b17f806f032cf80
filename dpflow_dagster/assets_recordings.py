"""Assets and checks of the recordings stage."""

from __future__ import annotations

import dagster as dg

defs = dg.Definitions()
