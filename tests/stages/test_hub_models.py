"""Hub ids and chat templates in `resolve_model`: a Hugging Face cache built in the test, never a download.

The cache is the real layout (`models--org--name/snapshots/<commit>/...` and `refs/main`) holding a tiny Llama
and a word-level tokenizer saved by transformers. Resolution runs in a child process with HF_HUB_CACHE pointing
at it, as a stage would see it, and with HF_HUB_OFFLINE=1 or a hub endpoint that refuses connections
(127.0.0.1:9): the tests never reach the network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage.checkpoints import sha256_local_file

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
NO_NETWORK = "http://127.0.0.1:9"  # the discard port: connections are refused at once


def save_tiny_model(directory: Path, seed: int, chat_template: str | None) -> Path:
    """A 2-layer Llama with a word-level tokenizer (eos `</s>`), saved by transformers into `directory`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "hello", "world", "<user>", "</user>"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def cache_model(cache: Path, repo_id: str, commit: str, seed: int, chat_template: str | None = TEMPLATE,
                main: bool = True) -> Path:
    """Save a tiny model as `repo_id` at `commit` in a hub cache; `main`: make it what refs/main points to."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = save_tiny_model(repo / "snapshots" / commit, seed, chat_template)
    if main:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


def resolve(cache: Path, env: dict[str, str] | None = None, **model: str) -> dict[str, str]:
    """resolve_model(ModelConfig(**model)) in a child process that sees `cache` as its hub cache: {"path"} or
    {"error"} (a ModelError's message)."""
    script = (
        "import json, sys\n"
        "from schemas.config import ModelConfig\n"
        "from stages.generation.models import ModelError, resolve_model\n"
        "try:\n"
        "    print(json.dumps({'path': str(resolve_model(ModelConfig(**json.loads(sys.argv[1]))))}))\n"
        "except ModelError as error:\n"
        "    print(json.dumps({'error': str(error)}))\n"
    )
    child_env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": NO_NETWORK,
                 "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})}
    done = subprocess.run([sys.executable, "-c", script, json.dumps(model)], cwd=REPO, env=child_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("hf-hub")
    cache_model(cache, "tiny-org/tiny-llama", "a" * 40, seed=1)
    cache_model(cache, "tiny-org/tiny-llama", "b" * 40, seed=2, main=False)  # an older revision, also cached
    cache_model(cache, "tiny-org/no-template", "c" * 40, seed=3, chat_template=None)
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot_without_network(hub_cache: Path) -> None:
    snapshots = hub_cache / "models--tiny-org--tiny-llama" / "snapshots"
    for env in ({"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0"}):  # the cache is read first, online or not
        assert resolve(hub_cache, env, name_or_path="tiny-org/tiny-llama") == {"path": str(snapshots / ("a" * 40))}
    assert resolve(hub_cache, name_or_path="tiny-org/tiny-llama", revision="b" * 40) == {
        "path": str(snapshots / ("b" * 40))}
    weights = [sha256_local_file(snapshots / rev / "model.safetensors") for rev in ("a" * 40, "b" * 40)]
    assert weights[0] != weights[1]  # two revisions really are two models


@pytest.mark.parametrize("env, why", [({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
                                      ({"HF_HUB_OFFLINE": "0"}, "Connection refused")])
def test_a_model_missing_from_the_cache_offline_is_one_line_naming_the_fetch_command(
    hub_cache: Path, env: dict[str, str], why: str
) -> None:
    error = resolve(hub_cache, env, name_or_path="tiny-org/absent")["error"]
    assert "\n" not in error
    assert error.startswith(f"model tiny-org/absent is not in the Hugging Face cache {hub_cache} ")
    assert why in error and "`hf download tiny-org/absent`" in error
    error = resolve(hub_cache, env, name_or_path="tiny-org/tiny-llama", revision="v2")["error"]
    assert "model tiny-org/tiny-llama@v2 is not in" in error
    assert "`hf download tiny-org/tiny-llama --revision v2`" in error


def test_a_partial_snapshot_names_what_is_missing_and_how_to_complete_it(tmp_path: Path) -> None:
    snapshot = cache_model(tmp_path, "tiny-org/partial", "d" * 40, seed=4)
    (snapshot / "model.safetensors").unlink()
    error = resolve(tmp_path, name_or_path="tiny-org/partial")["error"]
    assert f"model directory {snapshot} has no model.safetensors" in error
    assert "complete it with `hf download tiny-org/partial`" in error


def test_a_tokenizer_without_chat_template_is_refused_naming_the_model(hub_cache: Path) -> None:
    error = resolve(hub_cache, name_or_path="tiny-org/no-template")["error"]
    assert error.startswith("model tiny-org/no-template (") and "has no chat template" in error
    assert "set model.chat_template" in error


def test_model_chat_template_supplies_the_template_through_a_linked_copy(hub_cache: Path, tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    model = {"name_or_path": "tiny-org/no-template", "chat_template": str(template), "cache_dir": str(tmp_path / "c")}
    copy = Path(resolve(hub_cache, **model)["path"])
    snapshot = hub_cache / "models--tiny-org--no-template" / "snapshots" / ("c" * 40)
    assert copy.parent == tmp_path / "c" / "templated" and copy.name.startswith(("c" * 40) + "-")
    assert (copy / "chat_template.jinja").read_text() == template.read_text()
    assert (copy / "model.safetensors").resolve() == (snapshot / "model.safetensors").resolve()
    made = (copy / "chat_template.jinja").stat().st_mtime_ns
    assert resolve(hub_cache, **model) == {"path": str(copy)}  # the same copy, not rebuilt
    assert (copy / "chat_template.jinja").stat().st_mtime_ns == made
    template.write_text("{% for m in messages %}({{ m.content }}){% endfor %}")
    assert resolve(hub_cache, **model)["path"] != str(copy)  # another template: another model
    missing = resolve(hub_cache, **(model | {"chat_template": str(tmp_path / "absent.jinja")}))["error"]
    assert missing == f"model.chat_template {tmp_path / 'absent.jinja'} is not a file"


def test_the_templated_copy_loads_and_renders_with_the_configured_template(hub_cache: Path, tmp_path: Path) -> None:
    """The copy is a working model directory: load_tokenizer renders the file's template (replacing the
    tokenizer's own, for a model that has one) and load_model loads the snapshot's weights."""
    import torch

    from stages.generation.models import load_model, load_tokenizer
    from stages.generation.sampling import encode_prompts

    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }} world{% endfor %}")
    messages = [{"role": "user", "content": "hello"}]
    for name in ("tiny-org/no-template", "tiny-org/tiny-llama"):
        copy = resolve(hub_cache, name_or_path=name, chat_template=str(template), cache_dir=str(tmp_path))["path"]
        tokenizer = load_tokenizer(copy)
        assert tokenizer.apply_chat_template(messages, tokenize=False) == "hello world"
        encoded = encode_prompts(tokenizer, ["p"], [json.dumps(messages)], 16, "skip")  # the generate stage's path
        assert encoded.token_ids == [[3, 4]]  # "hello", "world"
    own = load_tokenizer(resolve(hub_cache, name_or_path="tiny-org/tiny-llama")["path"])
    assert own.apply_chat_template(messages, tokenize=False) == "<user>hello</user>"
    snapshot = hub_cache / "models--tiny-org--tiny-llama" / "snapshots" / ("a" * 40)
    linked, original = load_model(copy), load_model(snapshot)
    assert all(torch.equal(a, b) for a, b in zip(linked.state_dict().values(), original.state_dict().values(),
                                                  strict=True))


def test_the_base_model_stage_stops_with_exit_2_and_the_one_line(hub_cache: Path, tmp_path: Path) -> None:
    """The first stage of a run resolves the model: a hub model this machine cannot get is bad input (exit 2),
    reported as the one line, not a traceback."""
    from schemas.config import load_config
    from tests.support.stages import start_run

    start_run(load_config(None, ["run_id=r", "model.name_or_path=tiny-org/absent"]), str(tmp_path))
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": NO_NETWORK,
           "COLUMNS": "400"}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "stage", "base_model", "--run", "r", "--root",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    [line] = [line for line in (done.stdout + done.stderr).splitlines() if "tiny-org/absent" in line]
    assert line.startswith("✗ base_model: model tiny-org/absent is not in the Hugging Face cache")
    assert line.endswith("or point HF_HUB_CACHE at it")
