"""The overlapped schedule (`pipeline.max_staleness` N > 0): which stage instances run next, as plain functions.

The plan is every scheduled iteration stage of iterations 0..count-1 (`registry.iteration_stages`, so
`evaluate.every` holds), each with its upstream instances: those that write one of its inputs
(`registry.upstream_instances`). Nothing else orders them, so the schedule follows from the registry's wiring:
generate k reads checkpoint k-1-N, hence with N >= 1 generate and score of k+1 are ready while train k runs,
and generate k never starts before train k-1-N is done. Two lanes (`registry.LANES`), one stage at a time each,
as on two machines: `rollout` (generate, score, evaluate) and `train` (advantage, train). A free lane takes
its ready instance that comes first by (evaluate last, lowest iteration, stage order): sampling for the next
batch before judging a checkpoint keeps the trainer fed. Run-level stages run before the plan (strictly).

`drive` runs a plan with any `submit(instance) -> future` (Prefect task futures in flows/pipeline.py, a thread
pool in tests), waiting for the first to finish: after a failure nothing new starts, the running stage
finishes, then the first error is raised. Per-iteration hooks run in iteration order once an iteration's
stages are all done. No Prefect here.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from schemas.config import RunConfig
from stages.registry import ITERATION_STAGES, instance, iteration_stages, lane_of, upstream_instances
from storage.layout import StageInstance


class StageFuture(Protocol):
    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...

    def result(self) -> Any: ...


@dataclass(frozen=True)
class Plan:
    """Every instance of the overlapped part of a run, in strict order, with its upstream instances in the plan
    (those outside it, the run-level stages, are done before it starts)."""

    upstream: dict[StageInstance, frozenset[StageInstance]]

    @property
    def instances(self) -> list[StageInstance]:
        return list(self.upstream)

    def iteration_instances(self, iteration: int) -> list[StageInstance]:
        return [target for target in self.upstream if target.iteration == iteration]


def overlap_plan(config: RunConfig, count: int) -> Plan:
    """The plan of iterations 0..count-1 under `config` (round 0: overlap excludes dynamic sampling)."""
    targets = [instance(stage, k) for k in range(count) for stage in iteration_stages(config, k)]
    members = set(targets)
    return Plan({target: frozenset(upstream_instances(config, target) & members) for target in targets})


def priority(target: StageInstance) -> tuple[bool, int, int]:
    """Order among ready instances of one lane: evaluate last, then the lowest iteration, then stage order."""
    return target.stage == "evaluate", target.iteration, ITERATION_STAGES.index(target.stage)


def ready(plan: Plan, done: Collection[StageInstance], running: Collection[StageInstance]) -> list[StageInstance]:
    """Instances not done nor running whose upstream instances are all done, by `priority`."""
    waiting = [t for t in plan.upstream if t not in done and t not in running]
    return sorted((t for t in waiting if plan.upstream[t] <= set(done)), key=priority)


def next_starts(plan: Plan, done: Collection[StageInstance], running: Iterable[StageInstance]) -> list[StageInstance]:
    """What to start now: per lane with nothing running, its first ready instance."""
    running = list(running)
    busy = {lane_of(target.stage) for target in running}
    starts = []
    for target in ready(plan, done, running):
        if (lane := lane_of(target.stage)) not in busy:
            busy.add(lane)
            starts.append(target)
    return starts


class StalledPlan(RuntimeError):
    pass


def drive(
    plan: Plan, submit: Callable[[StageInstance], StageFuture], iteration_done: Callable[[int], None],
) -> list[Any]:
    """Run every instance of `plan` through `submit`, two lanes at once; the futures' results in finishing order.

    `iteration_done(k)` is called once per iteration, in order, when all of k's instances (and k-1's) are done.
    """
    finished: queue.Queue[StageInstance] = queue.Queue()
    running: dict[StageInstance, StageFuture] = {}
    done: set[StageInstance] = set()
    results: list[Any] = []
    failure: BaseException | None = None
    pending_iterations = sorted({target.iteration for target in plan.upstream})
    while True:
        if failure is None:
            for target in next_starts(plan, done, running):
                running[target] = future = submit(target)
                future.add_done_callback(lambda _, target=target: finished.put(target))
        if not running:
            break
        target = finished.get()
        try:
            results.append(running.pop(target).result())
        except BaseException as error:  # noqa: BLE001 - re-raised below, once the other lane's stage is done
            failure = failure or error
            continue
        done.add(target)
        while failure is None and pending_iterations and all(
            t in done for t in plan.iteration_instances(pending_iterations[0])
        ):
            try:
                iteration_done(pending_iterations.pop(0))
            except BaseException as error:  # noqa: BLE001 - as a failed stage: let the running one finish
                failure = error
    if failure is not None:
        raise failure
    if len(done) < len(plan.upstream):  # only a plan whose wiring has a cycle gets here
        stuck = sorted(set(plan.upstream) - done, key=priority)
        raise StalledPlan(f"no stage of {', '.join(t.label for t in stuck)} can start: their inputs form a cycle")
    return results
