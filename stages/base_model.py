"""Stage `base_model`: resolve the base model (converting the packaged GGUF once) and pin its content hash.

The base model is not copied into the run: its manifest records where it was found and the hash of every
file. A later stage, on this machine or another, resolves the same model config and refuses to go on if
the content hash differs, so a run can never silently continue from a different base model.
"""

from __future__ import annotations

from schemas.errors import InputError
from stages.generation.models import ModelError, resolve_model
from stages.harness import StageContext, exit_with
from storage.checkpoints import checkpoint_digest


def run(ctx: StageContext) -> None:
    try:
        model_dir = resolve_model(ctx.config.model)
    except ModelError as error:  # a model that is not there (offline: how to fetch it) is bad input, exit 2
        raise InputError(str(error)) from None
    digest, files, total = checkpoint_digest(model_dir)
    ctx.record_external_checkpoint(
        path=str(model_dir), sha256=digest, total_bytes=total,
        metrics={"local_path": str(model_dir), "name_or_path": ctx.config.model.name_or_path, "files": files},
    )


if __name__ == "__main__":
    exit_with("base_model", run)
