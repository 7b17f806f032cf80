"""dpflow's plug-in for training runs that Dagster Pipes launched (``dpflow_pipes.reporter``).

It lives outside ``dpflow_core`` so that the core library names no part of Dagster: the
trainer finds it as the ``dpflow.train_reporters`` entry point (``pyproject.toml``) through
:func:`dpflow_core.train.reporting.open_reporter`, and it imports the standalone
``dagster-pipes`` package only when both Pipes variables are set.
"""
