"""The generate and evaluate stages on the real vLLM CPU engine, as stage processes: what the default run
(`generate.backend: auto` -> vllm where it imports) does, at the smallest size that shows it.

A run of 1 train prompt x 2 samples x 16 tokens and 1 test prompt (greedy + 2 samples) is started with
`flows.cli.start_run`; `prompts` and `base_model` run in this process, then each model stage runs as
`python -m stages.<name>`, the way the flow starts it: a fresh process, so a fresh engine. Three engine starts
in all (each ~10 s on a 2-core CPU: the CPU default is fp32 and eager, nothing to compile):

1. generate: rows stamped `vllm`, logprobs <= 0, one per response token; the manifest has engine start apart
   from generation time, tokens/s, the engine's resolved settings (fp32, eager), the sampler/trainer
   `logprob_mismatch` (fp32 engine vs fp32 trainer: other kernels, so close but not bit-equal) and
   `deterministic: true`.
2. evaluate_base: the evaluate stage's own code (stages/evaluate_base.py only names it) on the base model,
   which needs no train stage; its manifest has the same engine figures.
3. generate again, in a new process, after its table and manifest were deleted: the table's bytes (content
   hash) are the first run's, the reproducibility docs/usage.md promises for vLLM on CPU across engine restarts.
"""

from __future__ import annotations

import importlib.util
import math
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
    # Three engine starts (up to ~8 minutes each cold, on a loaded 2-core box) plus model conversion.
    pytest.mark.timeout(3000),
]

N_SAMPLES, MAX_NEW_TOKENS, EVAL_SAMPLES = 2, 16, 2
STAGE_TIMEOUT_S = 1200
# fp32 sampler vs fp32 trainer per token: the humaneval-cpu recipe measured mean 5e-6, max 6e-5 (a bf16
# sampler: mean 0.021, max 0.28, ENVIRONMENT.md). The bounds catch a wrong logprob, not rounding.
MISMATCH_MEAN_BOUND = 1e-3
MISMATCH_MAX_BOUND = 0.05


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> RunLayout:
    from schemas.config import load_config
    from stages import base_model, prompts
    from stages.generation.vllm_backend import vllm_available
    from tests.support.stages import start_run

    if not vllm_available():
        pytest.skip("vllm does not import (see ENVIRONMENT.md: remove torchvision/torchaudio/torchcodec)")
    base = tmp_path_factory.mktemp("vllm-stage")
    overrides = h.run_overrides(
        base / "sources", "threads=2", "generate.backend=vllm", "generate.prompts_per_iteration=1",
        f"generate.n_samples={N_SAMPLES}", f"generate.max_new_tokens={MAX_NEW_TOKENS}",
        f"generate.mismatch_samples={N_SAMPLES}", "generate.vllm_kv_cache_gib=1",
        f"evaluate.n_samples={EVAL_SAMPLES}", f"evaluate.k=[1,{EVAL_SAMPLES}]",
        f"evaluate.max_new_tokens={MAX_NEW_TOKENS}", "score.workers=1",
        "generate.warm_engine=off",  # an engine per stage process (the warm one: test_warm_engine_stage.py)
    )
    layout = start_run(load_config(None, overrides), str(base / "root"))
    run_stage_at("prompts", layout, BASE, prompts.run)
    run_stage_at("base_model", layout, BASE, base_model.run)
    return layout


def run_stage_process(layout: RunLayout, stage: str, log: Path) -> None:
    """`python -m stages.<stage>` to completion; its output (progress bars, vLLM's log) is kept in `log`."""
    process = h.spawn(h.stage_command(layout, stage), layout.root, log)
    code = h.finish(process, STAGE_TIMEOUT_S)
    assert code == 0, f"{stage} exited {code}:\n{log.read_text(errors='replace')[-4000:]}"


def output_manifest_path(layout: RunLayout, stage: str) -> str:
    from stages.registry import STAGES

    (output,) = STAGES[stage].outputs(BASE if STAGES[stage].run_level else 0)
    return output.manifest_path(layout)


def output_manifest(layout: RunLayout, stage: str) -> Manifest:
    layout.fs.invalidate_cache()
    return read_manifest(layout.fs, output_manifest_path(layout, stage))


def assert_engine_figures(metrics: dict) -> None:
    """The figures both model stages record: which engine, its start apart from the generation, and speed."""
    assert metrics["backend"] == "vllm"
    assert metrics["engine"] == {"dtype": "float32", "compiled": False, "tensor_parallel_size": 1}  # CPU "auto"
    assert metrics["deterministic"] is True  # CPU engine, core in the stage process (vllm_backend.py)
    assert metrics["warm_engine"] == {"used": False, "reason": "generate.warm_engine is off"}
    assert metrics["engine_start_seconds"] > 1.0  # import + engine construction: never this fast
    assert metrics["generation_seconds"] > 0.0
    assert metrics["generated_tokens"] > 0
    assert metrics["tokens_per_second"] == pytest.approx(
        metrics["generated_tokens"] / metrics["generation_seconds"], rel=0.01)


def console_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the first generate stage printed (its console)."""
    return tmp_path_factory.getbasetemp() / "generate-1.log"


@pytest.fixture(scope="module")
def first_generate(vllm_run: RunLayout, tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    run_stage_process(vllm_run, "generate", console_log(tmp_path_factory))
    return output_manifest(vllm_run, "generate")


def test_vllm_log_lines_go_to_the_stage_log_file_not_the_console(
    vllm_run: RunLayout, first_generate: Manifest, tmp_path_factory: pytest.TempPathFactory
) -> None:
    stage_log = Path(vllm_run.run_dir) / "logs" / "generate@iter=0000.log"
    engine_lines = [line for line in stage_log.read_text().splitlines() if line.startswith(("INFO ", "WARNING "))]
    assert engine_lines, "vLLM logs at INFO when its engine starts"
    console = console_log(tmp_path_factory).read_text(errors="replace")
    assert not [line for line in console.splitlines() if line.startswith(("INFO ", "WARNING ", "(EngineCore"))]
    assert f"vLLM's log: {stage_log}" in console.replace("\n", "")


def test_generate_stage_on_vllm_writes_sampler_logprobs_and_engine_figures(
    vllm_run: RunLayout, first_generate: Manifest
) -> None:
    rows = pq.read_table(first_generate.path).to_pylist()
    assert first_generate.rows == len(rows) == N_SAMPLES  # 1 prompt x 2 samples
    assert sorted(r["sample_idx"] for r in rows) == list(range(N_SAMPLES))
    assert len({r["seed"] for r in rows}) == N_SAMPLES  # each sample its own seed
    for row in rows:
        assert row["backend"] == "vllm"
        assert 0 < row["num_tokens"] == len(row["response_token_ids"]) == len(row["response_logprobs"])
        assert row["num_tokens"] <= MAX_NEW_TOKENS
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in row["response_logprobs"])
        assert row["truncated"] == (row["finish_reason"] == "length")

    metrics = first_generate.metrics
    assert_engine_figures(metrics)
    assert metrics["generated_tokens"] == sum(r["num_tokens"] for r in rows)
    assert metrics["prompts"] == 1 and metrics["prompts_skipped_overlong"] == 0
    mismatch = metrics["logprob_mismatch"]
    assert mismatch["samples"] == N_SAMPLES
    assert mismatch["tokens"] + mismatch["outside_filter"] == metrics["generated_tokens"]
    # The fp32 engine against the fp32 trainer: close, but not equal (equal would mean it was not compared).
    assert 0.0 < mismatch["mean_abs"] < MISMATCH_MEAN_BOUND, mismatch
    assert mismatch["mean_abs"] <= mismatch["max_abs"] < MISMATCH_MAX_BOUND, mismatch


def test_evaluate_stage_on_vllm_records_engine_start(vllm_run: RunLayout, tmp_path: Path) -> None:
    run_stage_process(vllm_run, "evaluate_base", tmp_path / "evaluate_base.log")
    manifest = output_manifest(vllm_run, "evaluate_base")
    rows = pq.read_table(manifest.path).to_pylist()
    assert sorted((r["mode"], r["sample_idx"]) for r in rows) == [
        ("greedy", 0), *(("sampled", i) for i in range(EVAL_SAMPLES))]
    assert all(0 < r["num_tokens"] <= MAX_NEW_TOKENS for r in rows)
    assert_engine_figures(manifest.metrics)
    assert manifest.metrics["generated_tokens"] == sum(r["num_tokens"] for r in rows)
    (dataset,) = {r["dataset"] for r in rows}
    assert set(manifest.metrics[dataset]) >= {"greedy_accuracy", "pass@1", f"pass@{EVAL_SAMPLES}"}


def test_generate_rerun_in_a_fresh_process_reproduces_the_table(
    vllm_run: RunLayout, first_generate: Manifest, tmp_path: Path
) -> None:
    first_rows = pq.read_table(first_generate.path).to_pylist()
    vllm_run.fs.rm(first_generate.path)
    vllm_run.fs.rm(output_manifest_path(vllm_run, "generate"))
    run_stage_process(vllm_run, "generate", tmp_path / "generate-2.log")
    again = output_manifest(vllm_run, "generate")
    assert again.ended_at != first_generate.ended_at  # really generated again
    rows = pq.read_table(again.path).to_pylist()
    for before, after in zip(first_rows, rows, strict=True):  # a readable diff before the hash check
        assert after["response_token_ids"] == before["response_token_ids"], before["sample_idx"]
        assert after["response_logprobs"] == before["response_logprobs"], before["sample_idx"]
    assert again.sha256 == first_generate.sha256
    assert again.metrics["logprob_mismatch"]["max_abs"] == first_generate.metrics["logprob_mismatch"]["max_abs"]
