"""`python -m flows.cli`: the `rlpipe` command."""

import sys

from flows.cli.commands import main

sys.exit(main())
