"""The warm engine on the real vLLM CPU engine: generate and evaluate stages as processes (as the flow starts them)
sending their requests to the run's generation server, at the smallest size that shows it (1 train prompt x 2
samples x 16 tokens, 1 test prompt). In order:

1. `auto` with a memory reserve this machine cannot give: the stage runs an engine of its own (today's path)
   and its manifest says why; its table is the reference a fresh engine gives.
2. `on`: generate starts the server and its engine (`engine_started`), the server confirms the base model's
   hash (the manifest's `checkpoint_sha256` is the policy input's and every row's `policy_version`), and the
   table is byte for byte the fresh engine's (so `deterministic: true` stands on CPU).
3. evaluate_base uses the same engine (same `engine_id`) without starting one.
4. The server is SIGKILLed between two stages: the next generate starts a new one (new `engine_id`,
   `engine_started`, `server_starts: 1`) and still writes the same table.
5. In place: a perturbed copy of the model (another checkpoint, same tokenizer) is loaded with reload_weights;
   the warm engine's samples equal those of a fresh engine started on that copy, and differ from the base's.
   A directory whose hash is not the expected one is refused.
6. The flow's `stop_run_server` finds the stage-started server by the run and ends it.
7. The run's driver is SIGKILLed after a generate stage: the server, engine and all, ends within 60 s.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from storage.layout import BASE, RunLayout
from storage.manifest import Manifest, read_manifest
from tests.reliability import helpers as h
from tests.support.stages import run_stage_at

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
    pytest.mark.timeout(3000),
]

N_SAMPLES, MAX_NEW_TOKENS, EVAL_SAMPLES = 2, 16, 2
STAGE_TIMEOUT_S = 1200
OVERRIDES = (
    "threads=2", "device=cpu", "generate.backend=vllm", "generate.prompts_per_iteration=1",
    f"generate.n_samples={N_SAMPLES}", f"generate.max_new_tokens={MAX_NEW_TOKENS}", "generate.mismatch_samples=0",
    "generate.vllm_kv_cache_gib=1", f"evaluate.n_samples={EVAL_SAMPLES}", f"evaluate.k=[1,{EVAL_SAMPLES}]",
    f"evaluate.max_new_tokens={MAX_NEW_TOKENS}", "score.workers=1",
)
UNREACHABLE_RESERVE = "generate.warm_engine_min_free_gib=100000"


def configure(layout: RunLayout, sources: Path, *extra: str) -> None:
    from schemas.config import load_config
    from storage.run import Run

    Run.start(load_config(None, h.run_overrides(sources, *OVERRIDES, *extra)), layout.root, replace_config=True)


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 - yields (layout, sources)
    from schemas.config import load_config
    from stages import base_model, prompts
    from stages.generation.vllm_backend import vllm_available
    from tests.support.stages import start_run

    if not vllm_available():
        pytest.skip("vllm does not import (see ENVIRONMENT.md: remove torchvision/torchaudio/torchcodec)")
    base = tmp_path_factory.mktemp("warm-engine")
    sources = base / "sources"
    overrides = h.run_overrides(sources, *OVERRIDES, "generate.warm_engine=auto", UNREACHABLE_RESERVE)
    layout = start_run(load_config(None, overrides), str(base / "root"))
    run_stage_at("prompts", layout, BASE, prompts.run)
    run_stage_at("base_model", layout, BASE, base_model.run)
    yield layout, sources
    from flows.runner.generation_server import stop_run_server
    from storage.run import Run

    stop_run_server(Run.at(layout))  # whatever a failed test left running


def run_stage_process(layout: RunLayout, stage: str, log: Path) -> Manifest:
    process = h.spawn(h.stage_command(layout, stage), layout.root, log)
    code = h.finish(process, STAGE_TIMEOUT_S)
    assert code == 0, f"{stage} exited {code}:\n{log.read_text(errors='replace')[-4000:]}"
    return output_manifest(layout, stage)


def output_manifest(layout: RunLayout, stage: str) -> Manifest:
    from stages.registry import STAGES

    (output,) = STAGES[stage].outputs(BASE if STAGES[stage].run_level else 0)
    layout.fs.invalidate_cache()
    return read_manifest(layout.fs, output.manifest_path(layout))


def remove_rollouts(layout: RunLayout, manifest: Manifest) -> None:
    layout.fs.rm(manifest.path)
    layout.fs.rm(manifest.path + ".manifest.json")


def rows_of(manifest: Manifest) -> list[dict]:
    return pq.read_table(manifest.path).to_pylist()


@pytest.fixture(scope="module")
def fresh_generate(warm_run, tmp_path_factory: pytest.TempPathFactory) -> Manifest:  # noqa: ANN001
    layout, _ = warm_run
    return run_stage_process(layout, "generate", tmp_path_factory.mktemp("logs") / "generate-fresh.log")


@pytest.fixture(scope="module")
def warm_generate(warm_run, fresh_generate: Manifest, tmp_path_factory: pytest.TempPathFactory) -> Manifest:  # noqa: ANN001
    layout, sources = warm_run
    remove_rollouts(layout, fresh_generate)
    configure(layout, sources, "generate.warm_engine=on")
    return run_stage_process(layout, "generate", tmp_path_factory.mktemp("logs") / "generate-warm.log")


def test_auto_runs_an_engine_of_its_own_when_memory_does_not_allow(fresh_generate: Manifest) -> None:
    record = fresh_generate.metrics["warm_engine"]
    assert record["used"] is False
    assert record["reason"].startswith("memory: ") and "warm_engine_min_free_gib=100000" in record["reason"]
    assert fresh_generate.metrics["engine_start_seconds"] > 1.0  # an engine started in the stage


def test_warm_engine_confirms_the_checkpoint_and_gives_the_fresh_engines_table(
    fresh_generate: Manifest, warm_generate: Manifest
) -> None:
    record = warm_generate.metrics["warm_engine"]
    assert record["used"] is True and record["engine_started"] is True and record["server_starts"] == 1
    assert record["checkpoint_sha256"] == warm_generate.inputs["policy"]
    rows, fresh_rows = rows_of(warm_generate), rows_of(fresh_generate)
    assert {r["policy_version"] for r in rows} == {record["checkpoint_sha256"]}
    assert warm_generate.metrics["deterministic"] is True
    assert warm_generate.metrics["engine"] == {"dtype": "float32", "compiled": False, "tensor_parallel_size": 1}
    for warm, fresh in zip(rows, fresh_rows, strict=True):  # a readable diff before the hash check
        assert warm["response_token_ids"] == fresh["response_token_ids"], fresh["sample_idx"]
        assert warm["response_logprobs"] == fresh["response_logprobs"], fresh["sample_idx"]
    assert warm_generate.sha256 == fresh_generate.sha256


def test_evaluate_uses_the_running_engine_without_starting_one(
    warm_run, warm_generate: Manifest, tmp_path: Path  # noqa: ANN001
) -> None:
    layout, _ = warm_run
    evaluated = run_stage_process(layout, "evaluate_base", tmp_path / "evaluate_base.log")
    record, started = evaluated.metrics["warm_engine"], warm_generate.metrics["warm_engine"]
    assert record["used"] is True and record["engine_started"] is False and record["server_starts"] == 0
    assert record["engine_id"] == started["engine_id"] and record["server_pid"] == started["server_pid"]
    assert record["checkpoint_sha256"] == evaluated.inputs["policy"] and record["reloads"] == 0
    assert evaluated.metrics["engine_start_seconds"] < warm_generate.metrics["engine_start_seconds"]
    assert sorted((r["mode"], r["sample_idx"]) for r in rows_of(evaluated)) == [
        ("greedy", 0), *(("sampled", i) for i in range(EVAL_SAMPLES))]


def test_a_killed_server_is_restarted_by_the_next_generate(
    warm_run, fresh_generate: Manifest, warm_generate: Manifest, tmp_path: Path  # noqa: ANN001
) -> None:
    layout, _ = warm_run
    killed = warm_generate.metrics["warm_engine"]
    os.kill(killed["server_pid"], signal.SIGKILL)
    remove_rollouts(layout, warm_generate)
    again = run_stage_process(layout, "generate", tmp_path / "generate-after-kill.log")
    record = again.metrics["warm_engine"]
    assert record["used"] is True and record["engine_started"] is True and record["server_starts"] == 1
    assert record["engine_id"] != killed["engine_id"] and record["server_pid"] != killed["server_pid"]
    assert again.sha256 == fresh_generate.sha256


def perturbed_copy(model_dir: Path, target: Path) -> Path:
    """Another checkpoint of the same model: one weight matrix moved by noise, tokenizer and config unchanged."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, target, ignore=shutil.ignore_patterns(".*"))
    weights = load_file(str(model_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.02 * torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(0))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_a_checkpoint_loaded_in_place_samples_as_a_fresh_engine_on_it(
    warm_run, model_dir: Path, prompt_ids: list[list[int]], tmp_path: Path  # noqa: ANN001
) -> None:
    from stages.generation import make_backend
    from stages.generation.base import GenerationRequest, SamplingSpec
    from stages.generation.client import WarmEngine, WarmEngineError, server_address
    from storage.checkpoints import checkpoint_digest
    from storage.run import Run

    layout, _ = warm_run
    config = Run.at(layout).config
    address = server_address(layout.run_dir, config.generate, config.device)
    other = perturbed_copy(model_dir, tmp_path / "iter=0000")
    base_hash, other_hash = checkpoint_digest(model_dir)[0], checkpoint_digest(other)[0]
    requests = [GenerationRequest(ids, seed) for ids in prompt_ids[:2] for seed in (11, 12)]
    sampled, greedy = SamplingSpec(max_new_tokens=MAX_NEW_TOKENS), SamplingSpec(temperature=0.0, max_new_tokens=8)

    base_samples = WarmEngine(address, config.generate, "cpu", model_dir, base_hash).generate(requests, sampled)
    warm = WarmEngine(address, config.generate, "cpu", other, other_hash)
    assert warm.reloads == 1 and warm.record()["checkpoint_sha256"] == other_hash
    warm_samples = warm.generate(requests, sampled) + warm.generate(requests[:1], greedy)
    with pytest.raises(WarmEngineError) as refused:
        WarmEngine(address, config.generate, "cpu", other, base_hash)
    assert refused.value.refused == "hash_mismatch"

    started = time.monotonic()
    fresh = make_backend("vllm", other, config.generate)
    try:
        fresh_samples = fresh.generate(requests, sampled) + fresh.generate(requests[:1], greedy)
    finally:
        fresh.close()
    print(f"fresh engine on the copy: {time.monotonic() - started:.1f} s; reload: {warm.reload_seconds:.2f} s")
    for warm_sample, fresh_sample in zip(warm_samples, fresh_samples, strict=True):
        assert warm_sample.token_ids == fresh_sample.token_ids
        assert warm_sample.logprobs == fresh_sample.logprobs
    assert all(b.logprobs != w.logprobs for b, w in zip(base_samples, warm_samples, strict=False))


def test_the_flow_stops_the_server_a_stage_started(warm_run) -> None:  # noqa: ANN001
    from flows.runner.generation_server import stop_run_server
    from stages.generation.client import ping, server_address
    from storage.run import Run

    layout, _ = warm_run
    run = Run.at(layout)
    address = server_address(layout.run_dir, run.config.generate, run.config.device)
    described = ping(address)
    assert described is not None and described["engine_id"] is not None
    assert stop_run_server(run) is True
    assert process_ended(described["pid"]) and ping(address) is None


def process_ended(pid: int) -> bool:
    """Gone, or a zombie its new parent (init: the stage that started it has exited) has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_killed_runs_warm_engine_ends_within_a_minute(warm_run, tmp_path: Path) -> None:  # noqa: ANN001
    """Issue 29: the run's driver (a process holding the run lease, as a flow process does) is SIGKILLed after a
    generate stage left the warm engine up: the server, engine and all, exits within 60 s (one read of the
    lease, 10 s), not after `warm_engine_idle_s`."""
    import psutil

    from tests.support.processes import start_run_driver

    layout, sources = warm_run
    configure(layout, sources, "generate.warm_engine=on")
    if (previous := output_manifest(layout, "generate")) is not None:  # None when run alone
        remove_rollouts(layout, previous)
    driver = start_run_driver(layout.root, layout.run_id)
    try:
        record = run_stage_process(layout, "generate", tmp_path / "generate.log").metrics["warm_engine"]
        rss_gib = psutil.Process(record["server_pid"]).memory_info().rss / (1 << 30)
    finally:
        driver.kill()
        driver.wait()
    killed = time.monotonic()
    while not process_ended(record["server_pid"]):
        assert time.monotonic() - killed < 60, "the warm engine outlived its run's driver by 60 s"
        time.sleep(0.2)
    print(f"warm engine ({rss_gib:.1f} GiB RSS) ended {time.monotonic() - killed:.1f} s after its run's driver")

