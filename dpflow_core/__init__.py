"""dpflow_core: the pure-Python library behind dpflow (no Dagster import, ever).

One module per stage of the procedure that turns Matrix Studio recordings into
a trained Diffusion Policy: recordings, pairing, conversion, dataset, remote,
runs, checkpoints, evaluation, and the built-in trainer in ``train/``.
"""

__version__ = "0.1.0"
