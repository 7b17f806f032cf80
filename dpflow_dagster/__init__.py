"""Dagster definitions for dpflow: thin assets over ``dpflow_core`` functions."""
