"""`python -m tests.reliability.overlap_driver ROOT RUN [--sequential]`: the `loop` flow's overlapped part without
Prefect, for the drills of tests/reliability/test_overlap.py: the plan and `drive` of flows/runner/overlap.py,
two lanes at once, each stage a process forked from the real stage server with `--if-needed` and a lease wait,
as `flows.pipeline.run_stage_here` starts it (a sharded one as its shards at once, then the merge). Model stages
run their stand-in work (standin_stage.py), the others their real code. `--sequential`: the same plan one stage
at a time in strict order (the reference)."""

from __future__ import annotations

import sys
from concurrent.futures import Future, ThreadPoolExecutor

from flows.runner import forkserver
from flows.runner.overlap import drive, overlap_plan
from flows.runner.process import StageFailed, run_sharded, stage_environment
from stages.registry import is_done_now, shards_of
from storage.layout import RunLayout, StageInstance
from storage.run import Run
from tests.reliability.helpers import REAL


def stage_command(run: Run, target: StageInstance, *flags: str) -> list[str]:
    module = [f"stages.{target.stage}"] if target.stage in REAL else ["tests.reliability.standin_stage", target.stage]
    shard = ["--shard", f"{target.shard.index}/{target.shard.count}"] if target.shard else []
    return [sys.executable, "-m", *module, "--root", run.root, "--run", run.run_id, "--iter", str(target.iteration),
            *shard, *flags, "--if-needed", "--lock-wait", "60"]


def main() -> None:
    root, run_id, *flags = sys.argv[1:]
    run = Run.at(RunLayout.create(root, run_id))
    env = stage_environment(run.config)
    plan = overlap_plan(run.config, run.config.iterations)

    def start(target: StageInstance, *flags: str) -> None:
        if (code := forkserver.run(stage_command(run, target, *flags), env)) != 0:
            raise StageFailed(target, code)

    def execute(target: StageInstance) -> StageInstance:
        if not is_done_now(run, target):
            if shards_of(run.config, target):  # as run_stage_here: the shards at once, then the merge
                run_sharded(run, target, start, lambda whole: start(whole, "--merge"))
            else:
                start(target)
        return target

    with forkserver.stage_server(env):
        if "--sequential" in flags:
            for target in plan.instances:
                execute(target)
            return
        with ThreadPoolExecutor(2) as pool:
            def submit(target: StageInstance) -> Future:
                return pool.submit(execute, target)

            drive(plan, submit, iteration_done=lambda k: print(f"iteration {k} done", flush=True))


if __name__ == "__main__":
    main()
