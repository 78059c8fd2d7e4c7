"""`python -m tests.reliability.standin_stage <stage> --root R --run ID --iter K ...`: a model stage's stand-in work
(helpers.STANDINS) through the real stage entry point (`stages.harness.main`), as a module, so that the stage
fork server forks it as it forks `python -m stages.<name>` (tests/reliability/overlap_driver.py)."""

from __future__ import annotations

import sys

from stages.harness import main
from tests.reliability.helpers import STANDINS

if __name__ == "__main__":
    sys.exit(main(sys.argv[1], STANDINS[sys.argv[1]], sys.argv[2:]))
