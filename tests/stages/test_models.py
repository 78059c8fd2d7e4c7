"""stages/generation/models.py: the GGUF conversion round-trips exactly, is done once and safely.

The real conversion goes to the default cache (~/.cache/rlpipe/models), so the whole suite converts at most
once per machine; locking and atomicity are tested on tiny stand-in directories.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from schemas.config import ModelConfig
from stages.generation import models
from stages.generation.models import (
    ModelError,
    ensure_converted,
    gguf_path,
    load_model,
    load_tokenizer,
    resolve_model,
)
from storage.checkpoints import checkpoint_digest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model(ModelConfig())


def fake_model_dir(path: Path, weights: bytes = b"weights-v1") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")
    return path


# ---------------------------------------------------------------------------------------------------------
# The real default model


def test_default_model_directory_is_complete(smollm2_dir: Path) -> None:
    assert smollm2_dir == Path("~/.cache/rlpipe/models/smollm2-135m-instruct").expanduser().resolve()
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (smollm2_dir / name).is_file(), name
    # fp32: 134.5M parameters (embeddings tied, stored once) x 4 bytes, plus the safetensors header.
    assert 538_000_000 < (smollm2_dir / "model.safetensors").stat().st_size < 538_200_000
    config = (smollm2_dir / "config.json").read_text()
    assert '"quantization_config"' not in config and '"dtype": "float32"' in config


def test_tokenizer_has_chat_template_and_im_end_as_eos_and_pad(smollm2_dir: Path) -> None:
    tokenizer = load_tokenizer(smollm2_dir)
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    from transformers import GenerationConfig

    generation = GenerationConfig.from_pretrained(smollm2_dir)
    assert generation.eos_token_id == 2 and generation.pad_token_id == 2


@pytest.mark.slow  # loads the GGUF again (~1.5 min on 2 busy cores)
def test_conversion_round_trips_exactly(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    gguf = gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    converted = load_model(smollm2_dir)
    tokenizer = load_tokenizer(smollm2_dir)
    assert not converted.training and converted.dtype == torch.float32

    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    reference_ids = reference_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    assert torch.equal(ids["input_ids"], reference_ids["input_ids"])

    with torch.no_grad():
        difference = (converted(**ids).logits - reference(**ids).logits).abs().max().item()
        assert difference == 0.0
        kwargs = {"max_new_tokens": 24, "do_sample": False}
        out = converted.generate(**ids, **kwargs)
        reference_out = reference.generate(**ids, **kwargs)
    prompt_length = ids["input_ids"].shape[1]
    text = tokenizer.decode(out[0, prompt_length:], skip_special_tokens=True)
    assert text == reference_tokenizer.decode(reference_out[0, prompt_length:], skip_special_tokens=True)
    assert len(text) > 20  # it said something


def test_second_resolve_is_fast_and_does_not_reconvert(smollm2_dir: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    started = time.perf_counter()
    assert resolve_model(ModelConfig()) == smollm2_dir
    assert time.perf_counter() - started < 0.5
    assert weights.stat().st_mtime_ns == before


def test_load_model_modes_and_dtypes(smollm2_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = load_model(smollm2_dir, dtype="bfloat16", train=True)
    assert model.training and model.dtype == torch.bfloat16
    assert "Loading weights" not in capfd.readouterr().err  # transformers' bar: not on a stage's console
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(smollm2_dir, dtype="float8")


# ---------------------------------------------------------------------------------------------------------
# Local directories and errors


def test_a_local_directory_resolves_to_itself(tmp_path: Path) -> None:
    directory = fake_model_dir(tmp_path / "my-model")
    (directory / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert resolve_model(ModelConfig(name_or_path=str(directory))) == directory.resolve()


def test_missing_weights_config_or_tokenizer_are_named(tmp_path: Path) -> None:
    directory = fake_model_dir(tmp_path / "m")
    (directory / "model.safetensors").unlink()
    with pytest.raises(ModelError, match=r"has no model\.safetensors"):
        resolve_model(ModelConfig(name_or_path=str(directory)))
    fake_model_dir(directory)
    (directory / "config.json").unlink()
    with pytest.raises(ModelError, match=r"has no config\.json"):
        resolve_model(ModelConfig(name_or_path=str(directory)))
    fake_model_dir(directory)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match=r"has no tokenizer"):
        resolve_model(ModelConfig(name_or_path=str(directory)))


def test_a_name_that_is_neither_a_directory_nor_cached_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="is not a directory"):
        resolve_model(ModelConfig(name_or_path=str(tmp_path / "absent")))
    with pytest.raises(ModelError, match="is not a directory"):  # not a hub id (org/name) either: no download
        resolve_model(ModelConfig(name_or_path="no-such-org/no/such-model"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="is not a directory"):
        resolve_model(ModelConfig(name_or_path=str(tmp_path / "file")))


# ---------------------------------------------------------------------------------------------------------
# Conversion: once, locked, atomic (a stand-in converter; the real one is covered above)


# A child converts with a stand-in converter that logs its pid and takes 0.5 s. Children are fresh
# interpreters, not forks of pytest: a fork inherits the whole suite's threads and exit handlers.
_CHILD = """
import os, sys, time
from pathlib import Path
from stages.generation import models

def slow_fake_convert(gguf: Path, out_dir: Path) -> None:
    with open(gguf.parent / "conversions.log", "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text('{"model_type": "llama"}')
    (out_dir / "model.safetensors").write_bytes(b"weights-v1")
    (out_dir / "tokenizer.json").write_text("{}")

models.convert_gguf = slow_fake_convert
models.ensure_converted(Path(sys.argv[1]), Path(sys.argv[2]))
"""


def test_two_processes_convert_once(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    target = tmp_path / "cache" / "model"
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(gguf), str(target)],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    for child in children:
        output, _ = child.communicate(timeout=60)
        assert child.returncode == 0, output
    assert len((tmp_path / "conversions.log").read_text().splitlines()) == 1
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_crashed_conversion_leaves_nothing_that_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(gguf: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")  # half written
        raise RuntimeError("killed")

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    target = tmp_path / "cache" / "model"
    monkeypatch.setattr(models, "convert_gguf", crash)
    with pytest.raises(RuntimeError, match="killed"):
        ensure_converted(gguf, target)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []

    # A hard kill cannot clean up: its temp dir stays, and the next conversion removes it.
    stale = target.parent / ".model.tmp-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(models, "convert_gguf", lambda gguf, out: fake_model_dir(out))
    assert ensure_converted(gguf, target) == target
    assert not stale.exists()
    assert checkpoint_digest(target)[0] == checkpoint_digest(fake_model_dir(tmp_path / "reference"))[0]
    assert oct(target.stat().st_mode & 0o777) == oct(0o755)


def test_a_damaged_conversion_is_redone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"gguf")
    target = fake_model_dir(tmp_path / "cache" / "model")
    (target / "model.safetensors").unlink()  # someone deleted the weights
    monkeypatch.setattr(models, "convert_gguf", lambda gguf, out: fake_model_dir(out, b"fresh"))
    ensure_converted(gguf, target)
    assert (target / "model.safetensors").read_bytes() == b"fresh"


def test_saving_and_loading_a_policy_print_nothing(tmp_path: Path) -> None:
    """A fresh process (DeepSpeed warns once, at its first import): saving a policy as the train stage does and
    loading it back put neither transformers' progress bars nor DeepSpeed's CPU-fallback warning on the console of
    `rlpipe run` (the stage's stdout and stderr)."""
    script = """
import sys
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from stages.generation.models import load_model
from stages.rl.checkpoint import TrainerState, save_policy

out, empty = Path(sys.argv[1]) / "policy", Path(sys.argv[1]) / "source"
empty.mkdir()
config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=64)
save_policy(LlamaForCausalLM(config), None, empty, out, TrainerState(global_step=1, iteration=0))
print(sum(p.numel() for p in load_model(out).parameters()))
"""
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == str(64 * 16 * 2 + 4 * 16 * 16 + 3 * 16 * 32 + 3 * 16)  # embed, head, ...
    for noise in ("Loading weights", "Writing model shards", "Setting accelerator"):  # DeepSpeed's is on stdout
        assert noise not in done.stdout + done.stderr, done.stdout + done.stderr
