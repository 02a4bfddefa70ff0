"""``python -m trace_gym.cli``: the ``trace-gym`` command, for a process started by path to
an interpreter (``trace_gym.cli.main`` would run a second copy of a module the package has
already imported)."""

import sys

from trace_gym.cli.main import main

sys.exit(main())
