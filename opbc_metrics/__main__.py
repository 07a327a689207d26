"""``python -m opbc_metrics``: the ``opbc-metrics`` command (see :mod:`opbc_metrics.cli`)."""

from __future__ import annotations

import sys

from opbc_metrics.cli import main

if __name__ == "__main__":  # imported (doctests, tools) it does nothing
    sys.exit(main())
