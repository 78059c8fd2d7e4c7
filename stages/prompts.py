"""Stage `prompts`: load the train and test prompt sets named in the config into the run's prompts table.

Run once per run. Everything later reads prompts from this table (never from the source files again), so
the run keeps working, and stays auditable, if a source file moves or changes.
"""

from __future__ import annotations

import pyarrow as pa

from schemas.errors import InputError
from stages.data.sources import DataError, load_splits
from stages.harness import StageContext, exit_with


def run(ctx: StageContext) -> None:
    data = ctx.config.data
    try:
        train, test = load_splits(data)
    except DataError as error:
        raise InputError(str(error)) from None
    if train.num_rows == 0:
        raise InputError(f"data.train {data.train!r} yields no train prompts")
    if test.num_rows == 0:
        raise InputError(f"data.test {data.test!r} yields no test prompts")
    ctx.write_table("prompts", pa.concat_tables([train, test]), {"train": train.num_rows, "test": test.num_rows})


if __name__ == "__main__":
    exit_with("prompts", run)
