"""``python -m kvtier``: the command line."""

import sys

from kvtier.cli import main

sys.exit(main())
