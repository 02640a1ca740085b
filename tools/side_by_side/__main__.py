"""``python -m tools.side_by_side ...`` from the repository root (the options: ``--help``, cli.py)."""

import sys

from tools.side_by_side.cli import main

sys.exit(main())
