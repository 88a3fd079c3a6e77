"""`python -m cache_service [flags]`: runs one cache service until SIGINT/SIGTERM (see `cli.build_parser`)."""

import sys

from cache_service.cli import main

sys.exit(main())
