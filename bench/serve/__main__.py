"""`python -m bench.serve [flags]`: the same as `kdamesh bench serve [flags]`."""

import sys

from bench.serve.cli import run_cli

sys.exit(run_cli())
