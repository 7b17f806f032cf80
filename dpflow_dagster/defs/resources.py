"""The resources of every asset (:func:`dpflow_dagster.resources.default_resources`)."""

from __future__ import annotations

import dagster as dg

from dpflow_dagster.resources import default_resources

defs = dg.Definitions(resources=default_resources())
