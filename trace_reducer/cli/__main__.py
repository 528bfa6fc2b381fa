"""`python -m trace_reducer.cli`: the same command as `trace-reducer`."""

import sys

from . import main

sys.exit(main())
