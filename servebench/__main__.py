"""`python -m servebench [flags]`: the same as `kdamesh bench serve [flags]`."""

import sys

from servebench.cli import run_cli

sys.exit(run_cli())
