"""An `s3://` storage root against a real S3 API (moto's server on 127.0.0.1): tables, manifests, stages,
checkpoints.

S3 has no rename, so a write is one PUT (atomic by itself) and what makes an output count is its manifest,
written last: these tests check that an object without a manifest is never trusted, that a real stage
(prompts) runs against the bucket exactly as it does on a disk, and that a checkpoint goes up and comes back
byte for byte, with a changed or missing file named.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from flows.deploy import stop_processes
from schemas.config import load_config
from schemas.tables import PROMPTS
from stages import prompts
from stages.registry import STAGES, instance, stage_state
from storage.checkpoints import (
    CheckpointIntegrityError,
    checkpoint_digest,
    fetch_checkpoint,
    publish_checkpoint,
    verify_checkpoint,
)
from storage.fs import atomic_write_bytes, filesystem
from storage.layout import BASE
from storage.manifest import Manifest, output_intact, read_manifest, write_manifest
from storage.run import Run
from storage.tables import read_table, write_table
from tests.support.ports import free_port
from tests.support.processes import spawn_tied
from tests.support.stages import run_stage_at, start_run

BUCKET = "rlpipe-test"


def start_moto(log_dir: Path) -> tuple[subprocess.Popen, str]:
    """moto's S3 server on a free port of 127.0.0.1, with one bucket; returns (process, endpoint URL)."""
    import botocore.session
    import httpx

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    with open(log_dir / "moto.log", "ab") as log:
        process = spawn_tied(command, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(240):
        try:
            httpx.get(endpoint, timeout=2)
            break
        except httpx.HTTPError:
            assert process.poll() is None, (log_dir / "moto.log").read_text()
            time.sleep(0.5)
    client = botocore.session.get_session().create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    return process, endpoint


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, endpoint = start_moto(tmp_path_factory.mktemp("moto"))
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "RLPIPE_S3_ENDPOINT_URL": endpoint}.items():
            patch.setenv(name, value)
        try:
            yield endpoint
        finally:
            stop_processes([process], grace_s=5)


@pytest.fixture
def s3_root(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}"


def prompt_rows(n: int) -> list[dict]:
    return [{"prompt_id": f"p{i}", "dataset": "toy", "split": "train", "source_row": i, "messages": "[]",
             "reward_spec": '{"kind": "math", "answer": "1"}', "metadata": "{}"} for i in range(n)]


def test_write_is_one_object_and_manifest_makes_it_count(s3_root: str) -> None:
    fs = filesystem(s3_root)
    path = f"{s3_root}/t/prompts.parquet"
    atomic_write_bytes(fs, f"{s3_root}/t/blob.bin", b"x" * 10)
    written = write_table(fs, path, pa.Table.from_pylist(prompt_rows(4)), PROMPTS)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{s3_root}/t")) == ["blob.bin", "prompts.parquet"]
    assert hashlib.sha256(fs.cat_file(path)).hexdigest() == written.sha256
    assert read_table(fs, path, PROMPTS).to_pylist() == prompt_rows(4)

    # The object is there, but without a manifest nothing trusts it.
    manifest_path = path + ".manifest.json"
    assert read_manifest(fs, manifest_path) is None
    manifest = Manifest(stage="prompts", key="k", kind="table", path=path, sha256=written.sha256,
                        bytes=written.bytes, rows=4)
    write_manifest(fs, manifest_path, manifest)
    assert read_manifest(fs, manifest_path) == manifest and output_intact(fs, manifest)
    # Replaced by a different object of another size: the manifest no longer vouches for it.
    atomic_write_bytes(fs, path, b"not parquet")
    fs.invalidate_cache()
    assert not output_intact(fs, manifest)


def test_a_real_stage_on_s3_is_done_only_through_its_manifest(s3_root: str) -> None:
    config = load_config(None, ["run_id=s3run", "data.max_test_prompts=2"])
    layout = start_run(config, s3_root)
    assert layout.root == s3_root and layout.fs.exists(layout.config_path)
    spec = STAGES["prompts"]
    assert stage_state(Run(layout, config), instance("prompts")).reason == "missing"

    [manifest] = run_stage_at("prompts", layout, BASE, prompts.run)
    assert manifest.path == f"{s3_root}/runs/s3run/prompts.parquet" and manifest.rows > 0
    assert stage_state(Run(layout, config), instance("prompts")).done
    assert read_table(layout.fs, manifest.path, PROMPTS).num_rows == manifest.rows

    # A stage that died after writing its table but before its manifest: the table alone is not trusted.
    layout.fs.rm_file(spec.outputs(BASE)[0].manifest_path(layout))
    assert layout.fs.exists(manifest.path)
    assert stage_state(Run(layout, config), instance("prompts")).reason == "missing"


def fake_model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(os.urandom(3 << 20))  # several MiB: more than one read chunk
    (path / "tokenizer.json").write_text("{}")
    (path / "optimizer.pt").write_bytes(b"adam state")
    return path


def test_checkpoint_round_trip_and_integrity_failures_are_named(s3_root: str, tmp_path: Path) -> None:
    fs = filesystem(s3_root)
    source = fake_model_dir(tmp_path / "ckpt")
    destination = f"{s3_root}/runs/r/checkpoints/iter=0000"
    publish_checkpoint(fs, source, destination)
    digest, files, total = checkpoint_digest(source)
    manifest = Manifest(stage="train", key="k", kind="checkpoint", path=destination, sha256=digest, bytes=total,
                        files=files)
    write_manifest(fs, f"{destination}/manifest.json", manifest)
    assert verify_checkpoint(fs, manifest) == []

    fetched = fetch_checkpoint(fs, manifest, tmp_path / "cache")
    assert fetched.name == digest
    for name in files:
        assert (fetched / name).read_bytes() == (source / name).read_bytes(), name
    assert fetch_checkpoint(fs, manifest, tmp_path / "cache") == fetched  # cached by content hash

    # Same size, other bytes (a corrupted upload); and a file gone.
    weights = f"{destination}/model.safetensors"
    fs.pipe_file(weights, os.urandom(files["model.safetensors"]["bytes"]))
    fs.rm_file(f"{destination}/tokenizer.json")
    fs.invalidate_cache()
    problems = verify_checkpoint(fs, manifest)
    assert any("model.safetensors: content differs" in p for p in problems)
    assert any("tokenizer.json: missing" in p for p in problems)
    fs.pipe_file(f"{destination}/tokenizer.json", (source / "tokenizer.json").read_bytes())
    with pytest.raises(CheckpointIntegrityError, match="model.safetensors"):
        fetch_checkpoint(fs, manifest, tmp_path / "other-cache")
    assert not [p for p in (tmp_path / "other-cache").iterdir() if p.name.startswith(".")]  # no staging left
