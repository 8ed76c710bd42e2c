"""`python -m plait.cli ...` runs the `plait` command."""

import sys

from plait.cli.main import main

sys.exit(main())
