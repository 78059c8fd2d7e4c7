"""The one error for bad input data, raised by stages and the libraries alike.

Its message names the file, row or field; the stage harness turns it into exit code 2. It lives in `schemas/`,
the room every other room may import, so a library (batch building, scoring, the roll-out loop) can raise it
without importing a stage.
"""

from __future__ import annotations


class InputError(ValueError):
    """Bad input data: the stage fails with exit code 2 and this message, naming file, row or field."""
