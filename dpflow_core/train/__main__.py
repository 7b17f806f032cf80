"""``python -m dpflow_core.train``: see :mod:`dpflow_core.train.app`."""

from dpflow_core.train.app import main

if __name__ == "__main__":
    main()
