"""Checkpoint content hashes: the policy identity, per-file integrity, verified publish and fetch."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from storage import checkpoints
from storage.checkpoints import checkpoint_digest, directory_files, publish_checkpoint, verify_checkpoint
from storage.fs import filesystem
from storage.manifest import Manifest


def fake_model_dir(path: Path, weights: bytes = b"weights-v1") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "tokenizer.json").write_text("{}")
    return path


def test_digest_matches_its_definition_and_ignores_optimizer_state(tmp_path: Path) -> None:
    directory = fake_model_dir(tmp_path / "m")
    lines = "".join(
        f"{name}\t{hashlib.sha256((directory / name).read_bytes()).hexdigest()}\n"
        for name in ("config.json", "model.safetensors", "tokenizer.json")
    )
    expected = hashlib.sha256(lines.encode()).hexdigest()
    assert checkpoint_digest(directory)[0] == expected
    (directory / "optimizer.pt").write_bytes(b"adam")
    (directory / "manifest.json").write_text("{}")
    digest, files, total = checkpoint_digest(directory)
    assert digest == expected  # optimizer state is not the policy...
    assert set(files) == {"config.json", "model.safetensors", "tokenizer.json", "optimizer.pt"}  # ...but is checked
    assert total == sum(info["bytes"] for info in files.values())


def test_digest_is_content_not_path_and_sees_same_size_rewrites(tmp_path: Path) -> None:
    first = checkpoint_digest(fake_model_dir(tmp_path / "a"))[0]
    assert checkpoint_digest(fake_model_dir(tmp_path / "b"))[0] == first
    directory = tmp_path / "a"
    (directory / "model.safetensors").write_bytes(b"weights-v2")  # same size, new bytes, new mtime
    assert checkpoint_digest(directory)[0] != first


def test_hash_cache_is_used_until_a_stat_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = fake_model_dir(tmp_path / "m")
    value = checkpoint_digest(directory)[0]
    calls: list[Path] = []
    original = checkpoints.sha256_local_file
    monkeypatch.setattr(checkpoints, "sha256_local_file", lambda p: calls.append(p) or original(p))
    assert checkpoint_digest(directory)[0] == value and calls == []
    stat = (directory / "config.json").stat()
    os.utime(directory / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert checkpoint_digest(directory)[0] == value and [p.name for p in calls] == ["config.json"]


def test_a_directory_without_model_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="none of the files"):
        checkpoint_digest(tmp_path)


def test_publish_then_verify_names_tampered_and_missing_files(tmp_path: Path) -> None:
    source = fake_model_dir(tmp_path / "src")
    destination = str(tmp_path / "dst")
    fs = filesystem(str(tmp_path))
    publish_checkpoint(fs, source, destination)
    digest, files, total = checkpoint_digest(source)
    manifest = Manifest(stage="train", key="k", kind="checkpoint", path=destination, sha256=digest, bytes=total,
                        files=files)
    assert verify_checkpoint(fs, manifest) == []
    assert directory_files(Path(destination)) == files
    (Path(destination) / "config.json").write_text('{"model_type": "other"}')
    (Path(destination) / "tokenizer.json").unlink()
    problems = verify_checkpoint(fs, manifest)
    assert any("config.json: content differs" in p for p in problems)
    assert any("tokenizer.json: missing" in p for p in problems)


def test_hashes_taken_while_writing_match_the_files_and_spare_the_digest_a_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    directory = fake_model_dir(tmp_path / "m", weights=os.urandom(3 << 20))
    state = {"exp_avg": torch.arange(300_000, dtype=torch.float32), "step": 3}
    with checkpoints.HashWhileWriting(directory) as hashes:
        hashes.hash_written()  # config, weights, tokenizer: in the background
        with hashes.open("optimizer.pt") as handle:  # chunk by chunk as torch.save writes it
            torch.save(state, handle)
        (directory / "trainer_state.json").write_text('{"global_step": 1}')
        hashes.hash_written()
    assert hashes.waited_seconds >= 0.0
    assert torch.load(directory / "optimizer.pt", weights_only=True)["step"] == 3
    reads: list[Path] = []
    original = checkpoints.sha256_local_file
    monkeypatch.setattr(checkpoints, "sha256_local_file", lambda p: reads.append(p) or original(p))
    files = directory_files(directory)
    assert reads == []  # every hash came from the writer
    names = {"config.json", "model.safetensors", "tokenizer.json", "optimizer.pt", "trainer_state.json"}
    assert set(files) == names
    for name in names:  # against an independent hash of each file as it is on disk
        content = (directory / name).read_bytes()
        assert files[name] == {"bytes": len(content), "sha256": hashlib.sha256(content).hexdigest()}


def test_a_file_rewritten_after_it_was_hashed_is_hashed_again(tmp_path: Path) -> None:
    directory = fake_model_dir(tmp_path / "m")
    with checkpoints.HashWhileWriting(directory) as hashes:
        hashes.hash_written()
    (directory / "model.safetensors").write_bytes(b"weights-v2-longer")  # the cached entry no longer fits
    files = directory_files(directory)
    assert files["model.safetensors"]["sha256"] == hashlib.sha256(b"weights-v2-longer").hexdigest()


def test_a_copy_takes_its_sources_cached_hash_only_while_that_still_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    source = fake_model_dir(tmp_path / "src")
    expected = directory_files(source)  # fills the source's hash cache
    (source / "tokenizer.json").write_text('{"changed": 1}')  # its cached hash no longer fits
    reads: list[str] = []
    original = checkpoints.sha256_local_file
    monkeypatch.setattr(checkpoints, "sha256_local_file", lambda p: reads.append(p.name) or original(p))
    copy = tmp_path / "copy"
    copy.mkdir()
    with checkpoints.HashWhileWriting(copy) as hashes:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            shutil.copy2(source / name, copy / name)
            hashes.copied(source / name, name)
    assert reads == ["tokenizer.json"]  # the two unchanged files were not read again
    files = directory_files(copy)
    assert files["model.safetensors"] == expected["model.safetensors"]
    assert files["tokenizer.json"]["sha256"] == hashlib.sha256(b'{"changed": 1}').hexdigest()
    assert reads == ["tokenizer.json"]
