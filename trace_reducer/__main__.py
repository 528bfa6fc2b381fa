"""`python -m trace_reducer`: the same command as `trace-reducer` (and `python -m
trace_reducer.cli`), for an environment whose scripts directory is not on PATH."""

import sys

from .cli import main

sys.exit(main())
