"""``python -m cute_kernels.contest test|benchmark|leaderboard PROBLEM_DIR [options]``."""

import sys

from .harness import main

sys.exit(main())
