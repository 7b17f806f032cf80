"""The definitions folder that ``dg`` loads (``[tool.dg.project] defs_module`` in pyproject.toml).

One module per stage, each holding one ``dg.Definitions``: :mod:`.recordings`, :mod:`.rollouts`,
:mod:`.dataset`, :mod:`.lerobot`, :mod:`.remote`, :mod:`.training`; plus
:mod:`.pipeline` (the whole-graph job and the conversion automation sensor) and
:mod:`.resources`. :mod:`dpflow_dagster.definitions` merges them with
``dg.load_from_defs_folder``.
"""
