"""Multi-node DeepSpeed training for real, on this one machine as two nodes (gloo, the tiny model, one step).

Node 0 is the train stage (its launcher, `--no_ssh --node_rank 0`); node 1 is `rlpipe train-node RUN --node-rank
1`, a process of its own that takes the stage's job from the run's directory and starts its launcher with
`--node_rank 1`; the ranks meet at 127.0.0.1 on `train.master_port`. The same step on 2 nodes x 1 rank and on
1 node x 2 ranks (the same world size, the same data-parallel split) must give the same weights to fp32
rounding. A rank SIGKILLed on node 1 mid-job fails the stage (exit 1, naming node 1), leaves no process of the
job and nothing of the checkpoint, and the stage rerun whole (node 1 still serving) succeeds. Under a load of
~12 on 2 cores each takes about 3 minutes, most of it the processes' start-up (torch and DeepSpeed imports).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from stages import advantage
from stages import train as train_stage
from stages.rl.deepspeed_backend import READY, REPO_ROOT, nodes_dir
from storage.layout import RunLayout
from tests.reliability import helpers as h
from tests.support.processes import marked_processes, spawn_tied
from tests.support.stages import run_stage_at

from .pipeline_helpers import fake_generate, fake_score, run_iteration

pytestmark = pytest.mark.slow

MARK = "RLPIPE_TEST_MULTINODE"  # in the environment of every process a test starts, and so of their children


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_nodes(port: int) -> tuple[str, ...]:
    return ("train.backend=deepspeed", "train.processes=1", "train.nodes=2", "train.master_addr=127.0.0.1",
            f"train.master_port={port}")


def start_node_1(layout: RunLayout, marker: str, log: Path) -> subprocess.Popen:
    """`rlpipe train-node RUN --node-rank 1`: this machine as the run's second train node."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), MARK: marker}
    command = [sys.executable, "-m", "flows.cli", "train-node", layout.run_id, "--node-rank", "1",
               "--root", layout.root]
    with open(log, "w") as out:
        return spawn_tied(command, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)  # train-node's Ctrl-C: it kills a job it is running on the way out
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def job_processes(marker: str, node: subprocess.Popen) -> list[int]:
    """The launchers and ranks left of the test's jobs (everything it started, but node 1's server itself)."""
    return [pid for pid in marked_processes(MARK, marker) if pid != node.pid]


@pytest.mark.timeout(600)
def test_two_nodes_of_one_rank_train_as_one_node_of_two_ranks(
    run_layout: tuple[Callable[..., RunLayout], Path], tmp_path: Path
) -> None:
    """Proves: one optimizer step of a 2 nodes x 1 rank job (two launchers in no-ssh mode, node 1 a separate
    `rlpipe train-node` process) publishes the checkpoint of a 1 node x 2 ranks job: every weight tensor within
    fp32 rounding (rtol 1e-5, atol 1e-6; the step moves weights by ~lr = 1e-2), the same loss; node 1's rank wrote
    its ZeRO-1 optimizer shard into the checkpoint rank 0 published; node 1's server reports the job done."""
    make, model_dir = run_layout
    one_node = make("run_id=one", "train.backend=deepspeed", "train.processes=2")
    layout = make("run_id=two", *two_nodes(_free_port()))
    _, one_checkpoint, one_manifest = run_iteration(one_node, 0)

    marker = uuid.uuid4().hex
    node_log = tmp_path / "node1.log"
    node = start_node_1(layout, marker, node_log)
    try:
        _, checkpoint, manifest = run_iteration(layout, 0)
        h.wait_for(lambda: " done (log " in node_log.read_text(), 60, what="node 1 to report the job done")
        h.wait_for(lambda: not job_processes(marker, node), 30, what="node 1's launcher and rank to end")
    finally:
        stop(node)
    assert (manifest.metrics["nodes"], manifest.metrics["processes"], manifest.metrics["steps"]) == (2, 2, 1)
    assert (one_manifest.metrics["nodes"], one_manifest.metrics["processes"]) == (1, 2)
    ds_dir = Path(checkpoint.path) / "deepspeed"
    assert len(list(ds_dir.rglob("*optim_states.pt"))) == 2  # one ZeRO-1 shard per rank, node 1's among them

    expected = load_file(Path(one_checkpoint.path) / "model.safetensors")
    got = load_file(Path(checkpoint.path) / "model.safetensors")
    base = load_file(model_dir / "model.safetensors")
    assert expected.keys() == got.keys() == base.keys()
    assert any(not torch.allclose(base[key], expected[key], rtol=0, atol=1e-4) for key in base)  # the step moved them
    for key in expected:
        assert torch.allclose(got[key], expected[key], rtol=1e-5, atol=1e-6), key
    [one_row] = pq.read_table(one_node.table_path("train_metrics", 0)).to_pylist()
    [row] = pq.read_table(layout.table_path("train_metrics", 0)).to_pylist()
    assert row["loss"] == pytest.approx(one_row["loss"], rel=1e-5)
    assert (row["tokens"], row["sequences"]) == (one_row["tokens"], one_row["sequences"])


def is_rank(process: psutil.Process) -> bool:
    """A DeepSpeed rank by its command line; a process that has just exited (a zombie, or gone) is none."""
    try:
        return any(arg.startswith("--local_rank=") for arg in process.cmdline())
    except (psutil.ZombieProcess, psutil.NoSuchProcess):
        return False


@pytest.mark.timeout(600)
def test_a_rank_killed_on_node_1_fails_the_stage_and_its_rerun_succeeds(
    run_layout: tuple[Callable[..., RunLayout], Path], tmp_path: Path
) -> None:
    """Proves: node 1's rank SIGKILLed mid-job (once it is ready to train) makes the train stage process exit 1
    with an error naming node 1; no launcher or rank of the job is left on either node, the checkpoint's
    directory holds neither the checkpoint nor a half-written temporary, there is no train_metrics table and the
    job's directory is gone; the stage run again whole, node 1's server still up, publishes the checkpoint."""
    make, _ = run_layout
    # Steps enough that node 1's rank is still training when the test sees it ready: one step on a quiet machine
    # ends within the test's poll, and the stage then succeeded before the kill (CI, stop 35).
    layout = make(*two_nodes(_free_port()), "train.epochs=40")
    for stage, work in (("generate", fake_generate), ("score", fake_score(False)), ("advantage", advantage.run)):
        run_stage_at(stage, layout, 0, work)
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), MARK: marker}
    train = [sys.executable, "-m", "stages.train", "--run", layout.run_id, "--iter", "0", "--root", layout.root]
    jobs = nodes_dir(layout.run_dir, layout.run_id)
    checkpoints = Path(layout.checkpoint_dir(0)).parent
    node = start_node_1(layout, marker, tmp_path / "node1.log")
    try:
        stage_log = tmp_path / "stage.log"
        with open(stage_log, "w") as out:
            stage = spawn_tied(train, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

        def node_1_rank() -> psutil.Process | None:
            if not any(READY in log.read_text(errors="replace") for log in jobs.glob("*/job.json.node1.log")):
                return None
            ranks = [p for p in psutil.Process(node.pid).children(recursive=True) if is_rank(p)]
            return ranks[0] if ranks else None

        h.wait_for(lambda: node_1_rank() is not None or stage.poll() is not None, 300, poll_s=0.1,
                   what="node 1's rank to be ready")
        assert stage.poll() is None, stage_log.read_text()[-3000:]
        node_1_rank().kill()  # SIGKILL, by its place in node 1's process tree: train-node > runner > launch > rank
        assert stage.wait(timeout=300) == 1, stage_log.read_text()[-3000:]
        output = stage_log.read_text(errors="replace")
        assert "DeepSpeedLaunchError" in output and "node 1" in output, output[-3000:]
        h.wait_for(lambda: not job_processes(marker, node), 30, what="every launcher and rank of the job to end")
        assert node.poll() is None  # node 1 serves on
        assert sorted(p.name for p in checkpoints.iterdir()) == ["base"]  # nothing of iter=0000, not even a temporary
        assert not Path(layout.table_path("train_metrics", 0)).exists()
        assert not list(jobs.iterdir())

        checkpoint, _ = run_stage_at("train", layout, 0, train_stage.run)  # in this process: no second start-up
        assert (checkpoint.metrics["nodes"], checkpoint.metrics["steps"]) == (2, 40)
        assert (Path(layout.checkpoint_dir(0)) / "manifest.json").is_file()
        assert pq.read_table(layout.table_path("train_metrics", 0)).num_rows == 40
    finally:
        stop(node)
        for pid in marked_processes(MARK, marker):
            os.kill(pid, signal.SIGKILL)


def test_train_node_refuses_a_node_rank_the_run_does_not_have(
    run_layout: tuple[Callable[..., RunLayout], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Proves: `rlpipe train-node` with a node rank outside 1..nodes-1 exits 2 with one line naming the run's
    train.nodes, before it waits for any job."""
    from flows.cli.commands import main

    make, _ = run_layout
    layout = make(*two_nodes(29500))
    for rank in (0, 2):
        assert main(["train-node", layout.run_id, "--node-rank", str(rank), "--root", layout.root]) == 2
        assert f"--node-rank {rank}: run t trains on train.nodes=2 nodes, so the other nodes are 1..1" in (
            capsys.readouterr().out.replace("\n", ""))
