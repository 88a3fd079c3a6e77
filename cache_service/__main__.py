"""`python -m cache_service [flags]`: runs one cache service until SIGINT/SIGTERM (see `server.build_parser`)."""

import sys

from cache_service.server import main

sys.exit(main())
