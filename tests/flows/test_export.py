"""`rlpipe export`: each format loaded by the library that consumes it, and each bad input refused in one line.

The run is a synthetic one (tests/support/synthetic_runs.py: every table of a real run, no model) whose train
prompts are real: the verl fixture's rows (math, stdin/stdout, call-based, a LiveCodeBench case list, a custom
`style: model` row) read from Parquet as verl writes it, and HumanEval-style rows, by rlpipe's own readers, so
their ids are content hashes; sample 1 of every group is a two-turn conversation. SFT and DPO exports are read by
`datasets.load_dataset`, checked with TRL's `is_conversational` and `maybe_apply_chat_template` against chats
built here from the run's own tables, and prepared by TRL's SFTTrainer and DPOTrainer on a tiny model; the verl
export is read back by rlpipe's verl reader to the same prompts (ids and reward specs); `hf` by `load_from_disk`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from itertools import product
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from flows.cli.commands import main
from schemas.config import DataConfig, DataSource
from stages.data.export import export_run
from stages.data.sources import load_prompts
from tests.support.scratch import scratch_dir
from tests.support.synthetic_runs import SyntheticRun, SyntheticSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ITERATIONS, SAMPLES = 2, 4


def render(messages: list[dict[str, str]]) -> str:
    """TEMPLATE by hand: the chat text TRL should produce from a row."""
    return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)


def real_prompts(directory: Path) -> pa.Table:
    verl = directory / "verl.parquet"
    records = [json.loads(line) for line in (FIXTURES / "verl_rl.jsonl").read_text().splitlines() if line.strip()]
    pq.write_table(pa.Table.from_pylist(records), verl)
    sources = [DataSource(path=str(verl), format="verl"), DataSource(path=str(FIXTURES / "code_tests.jsonl"))]
    return pa.concat_tables([load_prompts(source, "train", DataConfig(train=[source])) for source in sources])


class RealPromptsRun(SyntheticRun):
    """A synthetic run on real train prompts, with sample 1 of every group a two-turn conversation."""

    def __init__(self, root: str, spec: SyntheticSpec, prompts: pa.Table) -> None:
        self.real = prompts
        super().__init__(root, replace(spec, train_prompts=prompts.num_rows))
        renamed = dict(zip(self.train_ids, prompts["prompt_id"].to_pylist(), strict=True))
        self.train_ids = [renamed[p] for p in self.train_ids]
        self.difficulty = {renamed.get(p, p): value for p, value in self.difficulty.items()}
        self.tests = {renamed.get(p, p): value for p, value in self.tests.items()}
        self.prompt_tokens = {renamed[p]: value for p, value in self.prompt_tokens.items()}

    def prompts_table(self) -> pa.Table:
        synthetic = super().prompts_table()
        return pa.concat_tables([self.real, synthetic.filter(pc.equal(synthetic["split"], "test"))])

    def iteration_tables(self, iteration: int, policy_version: str) -> dict[str, pa.Table]:
        tables = super().iteration_tables(iteration, policy_version)
        rollouts = tables["rollouts"]
        multi = [idx == 1 for idx in rollouts["sample_idx"].to_pylist()]
        conversation = [
            json.dumps([{"role": "assistant", "content": "first try"}, {"role": "user", "content": "test_a failed"},
                        {"role": "assistant", "content": text}]) if is_multi else None
            for is_multi, text in zip(multi, rollouts["response_text"].to_pylist(), strict=True)
        ]
        schema = rollouts.schema
        rollouts = rollouts.set_column(schema.get_field_index("conversation"), schema.field("conversation"),
                                       pa.array(conversation, pa.string()))
        rollouts = rollouts.set_column(schema.get_field_index("num_turns"), schema.field("num_turns"),
                                       pa.array([2 if m else 1 for m in multi], pa.int32()))
        return {**tables, "rollouts": rollouts}


@pytest.fixture(scope="module")
def run_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with scratch_dir(tmp_path_factory, "export") as directory:
        prompts = real_prompts(directory)
        spec = SyntheticSpec(run_id="r", iterations=ITERATIONS, n_samples=SAMPLES,
                             prompts_per_iteration=prompts.num_rows, with_eval=False)
        RealPromptsRun(str(directory / "root"), spec, prompts).write()
        yield directory / "root"


def run_tables(root: Path, name: str) -> list[dict]:
    """A table of every iteration of run r, read straight from its Parquet files."""
    if name == "prompts":
        return pq.read_table(root / "runs/r/prompts.parquet").to_pylist()
    files = [root / f"runs/r/iter={i:04d}/{name}.parquet" for i in range(ITERATIONS)]
    return [row for path in files for row in pq.read_table(path).to_pylist()]


def expected_chats(root: Path) -> dict[tuple[int, str, int], tuple[list[dict], list[dict]]]:
    """(iteration, prompt, sample) -> (prompt messages, response messages), from the run's tables."""
    prompts = {p["prompt_id"]: json.loads(p["messages"]) for p in run_tables(root, "prompts")}
    return {(r["iteration"], r["prompt_id"], r["sample_idx"]):
            (prompts[r["prompt_id"]], json.loads(r["conversation"]) if r["conversation"]
             else [{"role": "assistant", "content": r["response_text"]}])
            for r in run_tables(root, "rollouts")}


@pytest.fixture(scope="module")
def tokenizer() -> object:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "<pad>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = TEMPLATE
    return tok


def tiny_model() -> object:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=4, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                        bos_token_id=1, eos_token_id=2, pad_token_id=3))


def test_sft_of_the_last_iterations_passing_responses_is_what_trl_trains_on(run_root: Path, tokenizer: object,
                                                                             tmp_path: Path) -> None:
    from trl import SFTConfig, SFTTrainer
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    where = "iteration = 1 AND status = 'ok' OR iteration = 1 AND num_turns > 1"
    done = export_run(str(run_root), "r", "sft", tmp_path / "sft", where)
    scores = run_tables(run_root, "scores")
    wanted = sorted((s["iteration"], s["prompt_id"], s["sample_idx"]) for s in scores
                    if s["iteration"] == 1 and (s["status"] == "ok" or s["sample_idx"] == 1))
    assert done.rows == len(wanted) > SAMPLES  # every multi-turn row, and some passing ones
    manifest = json.loads((tmp_path / "sft" / "export.json").read_text())
    assert (manifest["run_id"], manifest["iterations"], manifest["where"], manifest["rows"]) == ("r", [1], where,
                                                                                                 len(wanted))
    rollouts_manifest = json.loads((run_root / "runs/r/iter=0001/rollouts.parquet.manifest.json").read_text())
    assert sorted(manifest["inputs"]) == ["iter=0001/batch", "iter=0001/rollouts", "iter=0001/scores", "run/prompts"]
    assert manifest["inputs"]["iter=0001/rollouts"] == rollouts_manifest["sha256"]

    dataset = datasets.load_dataset(str(tmp_path / "sft"))["train"]
    assert dataset.num_rows == len(wanted)
    message = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    assert dataset.features["messages"] == datasets.List(message)
    chats = expected_chats(run_root)
    got = []
    for row in dataset:
        assert is_conversational(row)
        key = (row["iteration"], row["prompt_id"], row["sample_idx"])
        got.append(key)
        prompt, response = chats[key]
        assert maybe_apply_chat_template(row, tokenizer) == {"text": render(prompt + response)}
        assert len(response) == (3 if row["sample_idx"] == 1 else 1)  # a conversation is exported whole
    assert sorted(got) == wanted

    trainer = SFTTrainer(model=tiny_model(), train_dataset=dataset, processing_class=tokenizer,
                         args=SFTConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False))
    assert trainer.train_dataset.num_rows == len(wanted) and "input_ids" in trainer.train_dataset.column_names


def test_dpo_pairs_every_higher_and_lower_reward_of_a_group(run_root: Path, tokenizer: object, tmp_path: Path) -> None:
    from trl import DPOConfig, DPOTrainer
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    done = export_run(str(run_root), "r", "dpo", tmp_path / "dpo")
    groups: dict[tuple[int, str], list[dict]] = {}
    for score in run_tables(run_root, "scores"):
        groups.setdefault((score["iteration"], score["prompt_id"]), []).append(score)
    wanted = sorted((iteration, prompt, a["sample_idx"], b["sample_idx"])
                    for (iteration, prompt), members in groups.items()
                    for a, b in product(members, members) if a["reward"] > b["reward"])
    assert done.rows == len(wanted) > 0

    dataset = datasets.load_dataset(str(tmp_path / "dpo"))["train"]
    chats = expected_chats(run_root)
    got = []
    for row in dataset:
        assert is_conversational(row) and row["chosen_reward"] > row["rejected_reward"]
        got.append((row["iteration"], row["prompt_id"], row["chosen_sample_idx"], row["rejected_sample_idx"]))
        prompt, chosen = chats[(row["iteration"], row["prompt_id"], row["chosen_sample_idx"])]
        rejected = chats[(row["iteration"], row["prompt_id"], row["rejected_sample_idx"])][1]
        assert maybe_apply_chat_template(row, tokenizer) == {
            "prompt": render(prompt) + "<assistant>", "chosen": render(chosen).removeprefix("<assistant>"),
            "rejected": render(rejected).removeprefix("<assistant>")}
    assert sorted(got) == wanted

    trainer = DPOTrainer(model=tiny_model(), ref_model=tiny_model(), train_dataset=dataset, processing_class=tokenizer,
                         args=DPOConfig(output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False))
    assert {"prompt_ids", "chosen_ids", "rejected_ids"} <= set(trainer.train_dataset.column_names)


def test_verl_export_reads_back_as_the_same_prompts(run_root: Path, tmp_path: Path) -> None:
    done = export_run(str(run_root), "r", "verl", tmp_path / "verl")
    prompts = [p for p in run_tables(run_root, "prompts") if p["split"] == "train"]
    assert done.rows == len(prompts)  # every prompt was used, each written once

    # What verl's RLHFDataset reads: datasets' Parquet loader, verl's columns, the prompt as a chat list.
    dataset = datasets.load_dataset("parquet", data_files=str(tmp_path / "verl" / "train.parquet"))["train"]
    assert dataset.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    assert dataset.features["reward_model"] == {"style": datasets.Value("string"),
                                                "ground_truth": datasets.Value("string")}
    gsm8k = [row for row in dataset if row["data_source"] == "openai/gsm8k"]
    assert [(row["ability"], row["reward_model"]) for row in gsm8k] == [("math", {"style": "rule",
                                                                                  "ground_truth": "72"})]

    source = DataSource(path=str(tmp_path / "verl" / "train.parquet"), format="verl")
    again = load_prompts(source, "train", DataConfig(train=[source])).to_pylist()
    by_id = {p["prompt_id"]: p for p in prompts}
    assert sorted(p["prompt_id"] for p in again) == sorted(by_id)  # ids are hashes of messages and spec: both kept
    for prompt in again:
        original = by_id[prompt["prompt_id"]]
        assert (prompt["messages"], prompt["reward_spec"]) == (original["messages"], original["reward_spec"])
    kinds = sorted(json.loads(p["reward_spec"])["kind"] for p in again)
    assert kinds == ["code_call", "code_stdio", "code_stdio", "code_tests", "code_tests", "code_tests", "custom",
                     "math"]


def test_hf_export_is_every_selected_row_with_every_column(run_root: Path, tmp_path: Path) -> None:
    done = export_run(str(run_root), "r", "hf", tmp_path / "hf", "sample_idx = 1 AND reward < 0.5")
    wanted = sorted((s["iteration"], s["prompt_id"]) for s in run_tables(run_root, "scores")
                    if s["sample_idx"] == 1 and s["reward"] < 0.5)
    dataset = datasets.load_from_disk(str(tmp_path / "hf"))
    assert done.rows == dataset.num_rows == len(wanted) > 0
    assert sorted(zip(dataset["iteration"], dataset["prompt_id"], strict=True)) == wanted
    columns = set(dataset.column_names)
    assert {"response_text", "conversation", "reward", "status", "advantage", "kept", "messages",
            "reward_spec"} <= columns
    assert json.loads((tmp_path / "hf" / "export.json").read_text())["rows"] == len(wanted)


def test_a_failed_write_leaves_nothing(run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pq, "write_table", full_disk)
    with pytest.raises(OSError):
        export_run(str(run_root), "r", "sft", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def the_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """`rlpipe ARGV` refused: exit code 2, one line of output in all, no traceback."""
    code = main(argv)
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert code == 2, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in output, lines
    return lines[0]


def test_bad_input_is_refused_in_one_line(run_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    base = ["export", "r", "--root", str(run_root), "--format", "sft", "--out", str(out)]
    assert the_one_line(capsys, [*base, "--where", "reward >"]).startswith(
        "--where 'reward >' is not a valid SQL condition on the export's columns: Parser Error: syntax error")
    line = the_one_line(capsys, [*base, "--where", "rewrd > 0"])
    assert 'Binder Error: Referenced column "rewrd" not found' in line
    assert the_one_line(capsys, [*base, "--where", "1 = 1; DROP VIEW rollouts"]).startswith("--where '1 = 1; DROP")
    total = ITERATIONS * SAMPLES * 8
    assert the_one_line(capsys, [*base, "--where", "reward > 99"]) == (
        f"--where 'reward > 99' selects no rollout of run r ({total} rollouts in all)")
    assert the_one_line(capsys, [*base[:1], "nope", *base[2:]]) == (
        f"run nope does not exist under {run_root} (no outputs with a manifest)")
    line = the_one_line(capsys, [*base[:5], "dpo", *base[6:], "--where", "sample_idx = 0"])  # one per group
    assert line == ("--where 'sample_idx = 0' selects 16 rollouts of run r, but no group has two with different "
                    "rewards: no chosen/rejected pair")
    line = the_one_line(capsys, [*base[:5], "parquet", *base[6:]])
    assert line == "--format 'parquet': expected one of sft, dpo, verl, hf"
    assert not out.exists() and list(tmp_path.iterdir()) == []

    out.mkdir()
    (out / "mine.txt").write_text("keep")
    assert the_one_line(capsys, base) == f"--out {out} exists: choose another path or pass --overwrite"
    assert (out / "mine.txt").read_text() == "keep"
    assert main([*base, "--overwrite"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["export.json", "train.parquet"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary or replaced folder left beside it
