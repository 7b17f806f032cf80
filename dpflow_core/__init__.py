"""dpflow_core: the pure-Python library behind dpflow (no Dagster import, ever).

One package or module per stage of the procedure that turns Matrix Studio
recordings into a trained Diffusion Policy: ``recordings/``, ``pairing``,
``conversion/``, ``replay_buffer/``, ``dataset``, ``export/`` (LeRobot),
``server/`` (the GPU server), ``runs/``, ``checkpoints``, ``evaluation``, and
the built-in trainer in ``train/``. The README's "How the code is laid out"
lists each one.
"""

__version__ = "0.1.0"
