"""`python -m agent_server`: the same command as `agent-server`, for an environment whose
scripts directory is not on PATH (or a checkout run in place)."""

import sys

from .cli import main

sys.exit(main())
