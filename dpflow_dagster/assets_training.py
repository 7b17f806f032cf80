"""Assets and checks of the training stage."""

from __future__ import annotations

import dagster as dg

defs = dg.Definitions()
