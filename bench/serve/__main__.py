"""`python -m bench.serve [flags]`: the same as `kdamesh bench serve [flags]` and `python -m servebench [flags]`."""

import sys

from servebench.cli import run_cli

sys.exit(run_cli())
