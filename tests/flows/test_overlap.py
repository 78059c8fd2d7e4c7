"""The overlapped schedule (flows/runner/overlap.py) as pure functions: hand-made states and a hand-computed
timeline, a simulation with random stage durations, `drive` with a thread pool (failure, hooks), the registry's
upstream derivation, and the lane pinning setting (schemas/settings.py, stages/harness.py)."""

from __future__ import annotations

import heapq
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from flows.runner.overlap import Plan, drive, next_starts, overlap_plan, ready
from schemas.config import ConfigError, RunConfig, load_config
from schemas.settings import lane_cpus
from stages.harness import pin_to_lane
from stages.registry import instance, lane_of, policy_step, sampler_output, upstream_instances
from storage.layout import BASE, StageInstance


def config(staleness: int, iterations: int = 4, every: int = 1) -> RunConfig:
    extra = ["train.is_level=token"] if staleness else []
    return load_config(None, [f"iterations={iterations}", f"pipeline.max_staleness={staleness}",
                              f"evaluate.every={every}", *extra])


def at(stage: str, k: int) -> StageInstance:
    return instance(stage, k)


def through(k: int, *stages: str) -> set[StageInstance]:
    """Every stage of iterations < k, and `stages` of iteration k."""
    return {at(s, j) for j in range(k) for s in ("generate", "score", "advantage", "train")} | {
        at(s, k) for s in stages}


def test_upstream_instances_follow_the_inputs() -> None:
    strict, stale = config(0), config(1)
    assert upstream_instances(strict, at("generate", 2)) == {instance("prompts"), at("train", 1)}
    assert upstream_instances(stale, at("generate", 2)) == {instance("prompts"), at("train", 0)}
    assert upstream_instances(stale, at("generate", 1)) == {instance("prompts"), instance("base_model")}
    # train 2 starts from checkpoint 1 whatever the staleness, and reads the batch and the rollouts of 2
    assert upstream_instances(stale, at("train", 2)) == {
        at("advantage", 2), at("generate", 2), at("train", 1), instance("base_model")}
    assert upstream_instances(stale, at("evaluate", 2)) == {instance("prompts"), at("train", 2)}


def test_with_staleness_1_generate_k_plus_1_is_ready_while_train_k_runs() -> None:
    plan = overlap_plan(config(1), 4)
    # iterations 0, 1 done, generate/score/advantage 2 done, train 2 running: generate 3 (checkpoint 1) starts
    done = through(2, "generate", "score", "advantage") | {at("evaluate", 0), at("evaluate", 1)}
    assert next_starts(plan, done, [at("train", 2)]) == [at("generate", 3)]
    # with evaluate 1 ready too, the rollout lane takes generate 3 first: sampling keeps the trainer fed
    assert next_starts(plan, done - {at("evaluate", 1)}, [at("train", 2)]) == [at("generate", 3)]
    # strict: generate 3 waits for train 2, and evaluate 1 goes
    strict = overlap_plan(config(0), 4)
    assert next_starts(strict, done - {at("evaluate", 1)}, [at("train", 2)]) == [at("evaluate", 1)]


def descendants(plan: Plan, root: StageInstance) -> set[StageInstance]:
    found: set[StageInstance] = set()
    while grown := {t for t, up in plan.upstream.items() if (up & (found | {root})) and t not in found}:
        found |= grown
    return found


def test_generate_k_never_starts_before_train_k_minus_1_minus_n() -> None:
    for staleness in (0, 1, 2):
        plan = overlap_plan(config(staleness, iterations=6), 6)
        for k in range(staleness + 1, 6):
            trained = at("train", k - 1 - staleness)
            # everything done that does not need train k-1-N: generate k still is not ready
            done = set(plan.instances) - descendants(plan, trained) - {trained}
            assert at("generate", k) in descendants(plan, trained)
            assert at("generate", k) not in ready(plan, done, [])
            assert at("generate", k) in ready(plan, done | {trained}, [])


def test_one_stage_per_lane_and_the_priority() -> None:
    plan = overlap_plan(config(1), 4)
    assert lane_of("generate") == lane_of("score") == lane_of("evaluate") == "rollout"
    assert lane_of("advantage") == lane_of("train") == "train"
    # nothing done: only generate 0 and generate 1 are ready, both rollout: the lower iteration goes
    assert next_starts(plan, set(), []) == [at("generate", 0)]
    assert next_starts(plan, {at("generate", 0)}, []) == [at("score", 0)]
    assert next_starts(plan, {at("generate", 0), at("score", 0)}, []) == [at("advantage", 0), at("generate", 1)]
    assert next_starts(plan, {at("generate", 0), at("score", 0)}, [at("generate", 1)]) == [at("advantage", 0)]


def simulate(plan: Plan, seconds: dict[str, float] | random.Random) -> dict[StageInstance, tuple[float, float]]:
    """A discrete-event run of `plan`: (start, end) of every instance, starting what `next_starts` says."""
    timeline: dict[StageInstance, tuple[float, float]] = {}
    events: list[tuple[float, int, StageInstance]] = []
    done: set[StageInstance] = set()
    running: set[StageInstance] = set()
    now, order = 0.0, 0
    while True:
        for target in next_starts(plan, done, running):
            assert target not in timeline, f"{target.label} started twice"
            length = seconds.uniform(0.1, 3.0) if isinstance(seconds, random.Random) else seconds[target.stage]
            timeline[target] = (now, now + length)
            running.add(target)
            order += 1
            heapq.heappush(events, (now + length, order, target))
        if not events:
            return timeline
        now, _, finished = heapq.heappop(events)
        running.discard(finished)
        done.add(finished)


def test_a_hand_computed_timeline() -> None:
    """generate 2 s, score 1, advantage 1, train 3, evaluate 1 (last iteration only), 3 iterations, N = 1.
    By hand: rollout lane g0 0-2, s0 2-3, g1 3-5, s1 5-6, (idle: g2 needs t0) g2 7-9, s2 9-10, e2 15-16;
    train lane a0 3-4, t0 4-7, a1 7-8, t1 8-11, a2 11-12, t2 12-15. 16 s; strict: 3 x 7 + 1 = 22 s."""
    seconds = {"generate": 2, "score": 1, "advantage": 1, "train": 3, "evaluate": 1}
    timeline = simulate(overlap_plan(config(1, iterations=3, every=10), 3), seconds)
    starts = {f"{t.stage[0]}{t.iteration}": start for t, (start, _) in timeline.items()}
    assert starts == {"g0": 0, "s0": 2, "g1": 3, "a0": 3, "t0": 4, "s1": 5, "g2": 7, "a1": 7, "t1": 8, "s2": 9,
                      "a2": 11, "t2": 12, "e2": 15}
    assert max(end for _, end in timeline.values()) == 16
    strict = simulate(overlap_plan(config(0, iterations=3, every=10), 3), seconds)
    assert max(end for _, end in strict.values()) == 22


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_random_durations_respect_staleness_lanes_and_run_everything_once(staleness: int) -> None:
    for seed in range(20):
        cfg = config(staleness, iterations=6, every=2)
        plan = overlap_plan(cfg, 6)
        timeline = simulate(plan, random.Random(seed))
        assert set(timeline) == set(plan.instances)  # every stage exactly once (simulate refuses a second start)
        for lane in ("rollout", "train"):
            spans = sorted(span for t, span in timeline.items() if lane_of(t.stage) == lane)
            assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:], strict=False))
        for k in range(6):
            start = timeline[at("generate", k)][0]
            trained = [j for j in range(6) if timeline[at("train", j)][1] <= start]
            newest = max(trained, default=BASE)
            sampler = sampler_output(cfg, k)
            assert sampler.iteration == newest or sampler.iteration in trained or sampler.iteration == BASE
            # the checkpoint it samples with is at most N versions behind the newest one there is
            newest_step = 0 if newest == BASE else newest + 1
            assert newest_step - policy_step(sampler) <= staleness
            assert k - policy_step(sampler) == min(staleness, k)  # train k starts from step k
            for t, (_, end) in timeline.items():  # upstream done first
                if t in plan.upstream[at("generate", k)]:
                    assert end <= start


def test_overlap_beats_strict_with_balanced_lanes() -> None:
    seconds = {"generate": 2, "score": 1, "advantage": 0.5, "train": 2.5, "evaluate": 1}
    overlapped = simulate(overlap_plan(config(1, iterations=8, every=100), 8), seconds)
    strict = simulate(overlap_plan(config(0, iterations=8, every=100), 8), seconds)
    makespan = [max(end for _, end in timeline.values()) for timeline in (strict, overlapped)]
    assert makespan[0] == 8 * 6 + 1
    assert makespan[0] / makespan[1] > 1.6


class Stages:
    """A thread pool standing in for the flow's task runner: each stage sleeps, records its span."""

    def __init__(self, fail: str | None = None, slow: str | None = None) -> None:
        self.pool = ThreadPoolExecutor(4)
        self.spans: dict[str, tuple[float, float]] = {}
        self.fail, self.slow = fail, slow
        self.lock = threading.Lock()

    def run(self, target: StageInstance) -> str:
        start = time.monotonic()
        time.sleep(1.0 if target.label == self.slow else 0.05)
        with self.lock:
            self.spans[target.label] = (start, time.monotonic())
        if target.label == self.fail:
            raise RuntimeError(f"{target.label} failed")
        return target.label

    def submit(self, target: StageInstance) -> Future:
        return self.pool.submit(self.run, target)


def test_drive_runs_two_lanes_at_once_and_hooks_in_iteration_order() -> None:
    stages, hooks = Stages(), []
    plan = overlap_plan(config(1, iterations=3), 3)
    results = drive(plan, stages.submit, iteration_done=lambda k: hooks.append((k, set(stages.spans))))
    assert sorted(results) == sorted(t.label for t in plan.instances)
    assert [k for k, _ in hooks] == [0, 1, 2]
    for k, finished in hooks:  # each hook once all of its iteration's stages had finished
        assert {t.label for t in plan.iteration_instances(k)} <= finished
    g1, t0 = stages.spans["generate iter=1"], stages.spans["train iter=0"]
    s1 = stages.spans["score iter=1"]
    assert max(g1[0], t0[0]) < min(g1[1], t0[1]) or max(s1[0], t0[0]) < min(s1[1], t0[1])  # ran at once


def test_a_failed_stage_stops_new_starts_lets_the_running_one_finish_then_raises() -> None:
    # generate 1 outlasts advantage 0 by far, so the failure comes while it runs, however loaded the machine
    stages, hooks = Stages(fail="advantage iter=0", slow="generate iter=1"), []
    plan = overlap_plan(config(1, iterations=3), 3)
    with pytest.raises(RuntimeError, match="advantage iter=0 failed"):
        drive(plan, stages.submit, iteration_done=hooks.append)
    # advantage 0 ran beside generate 1, which finished; nothing started after the failure, no hook ran
    assert set(stages.spans) == {"generate iter=0", "score iter=0", "generate iter=1", "advantage iter=0"}
    assert hooks == []


def test_lane_cpus_setting() -> None:
    os.environ["RLPIPE_LANE_CPUS"] = "rollout=0;train=1-3,5"
    try:
        assert lane_cpus() == {"rollout": {0}, "train": {1, 2, 3, 5}}
        os.environ["RLPIPE_LANE_CPUS"] = "rollout=0;train"
        with pytest.raises(ValueError, match="RLPIPE_LANE_CPUS.*'train' is not `lane=cores`"):
            lane_cpus()
        os.environ["RLPIPE_LANE_CPUS"] = "rollout=0;trainer=1"
        with pytest.raises(ConfigError, match="unknown lane trainer"):
            pin_to_lane("train")
    finally:
        del os.environ["RLPIPE_LANE_CPUS"]
    assert lane_cpus() == {}


def test_a_stage_process_runs_on_its_lanes_cores() -> None:
    """pin_to_lane in a child process (as the harness does at a stage's start): its affinity, and a process
    it starts (a generation server, a sandbox job) inherits it, as with taskset."""
    cores = sorted(os.sched_getaffinity(0))
    last = cores[-1]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: pin as the train stage, then report its own and a grandchild's affinity
        os.environ["RLPIPE_LANE_CPUS"] = f"rollout={cores[0]};train={last}"
        code = 1
        try:
            pin_to_lane("train")
            grandchild = os.popen("python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'").read().strip()
            os.write(write, f"{sorted(os.sched_getaffinity(0))}|{grandchild}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    report = os.read(read, 4096).decode()
    os.close(read)
    assert os.waitstatus_to_exitcode(status) == 0
    assert report == f"[{last}]|[{last}]"
    assert sorted(os.sched_getaffinity(0)) == cores  # the parent is untouched
