"""``python -m experiments.sweep``: see :mod:`experiments.sweep.cli`."""

from experiments.sweep.cli import main

raise SystemExit(main())
