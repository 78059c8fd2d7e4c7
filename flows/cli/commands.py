"""The `rlpipe` command line.

    rlpipe run [--config FILE] [--set section.field=value ...] [--run-id ID] [--root ROOT] [--debug] [--verbose]
    rlpipe resume RUN [--set ...] [--root ROOT] [--debug] [--verbose]     rlpipe status RUN [--root ROOT]
    rlpipe fork RUN NEW --at K [--set ...] [--config FILE] [--root ROOT]
    rlpipe stage NAME --run RUN [--iter K] [--root ROOT]
    rlpipe sandbox serve [--config FILE] [--host 127.0.0.1] [--port 8080]
    rlpipe train-node RUN --node-rank R [--root ROOT]                  (node R of a multi-node train stage)
    rlpipe query "SQL" [--out FILE]      rlpipe show RUN ITER PROMPT SAMPLE
    rlpipe lineage RUN [ITER]            rlpipe report RUN
    rlpipe server                        rlpipe deploy

Everything that can be checked before a stage runs is checked first: the config, the run id, the data files,
the reward functions, the trackers and (stages run here) the model. Errors name the file, line or field and exit
with code 2, before anything is written. A stage of a new run that refuses its input (exit 2) before the base
model is resolved leaves nothing worth resuming: its run directory is removed and the same `rlpipe run` starts
over. A failed stage prints its one line, not Prefect's traceback of the flow (`--debug` keeps it); vLLM's own
log lines go to each stage's log file under `runs/<run>/logs/`, not the console (`--verbose` keeps them). Prefect is
imported only by `run`/`resume` (the flow process); every other command stays fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from rich.console import Console

from schemas import settings
from schemas.config import ConfigError, InvalidRunId, RunConfig, apply_overrides, load_config, parse_config
from schemas.errors import InputError
from storage.layout import RunLayout
from storage.run import Run, RunRef, resolve_root

console = Console()


def _error(message: str) -> None:
    """A refusal or failure as one red line, as written: not wrapped to the terminal's (or a pipe's 80) columns, and
    not read as markup (a message's `[wandb]` or `rewards[0]` would be taken for a style)."""
    console.print(message, style="red", soft_wrap=True, markup=False, highlight=False)


def _validate_data(config: RunConfig) -> None:
    """The checks of a loaded config that need the libraries (a ConfigError, exit 2): the estimator against the
    rest of the config, the data sources, their reward kinds, the tools, the trackers."""
    import json

    from stages.data.sources import DataError, validate_sources
    from stages.rl.advantages import check_estimator_fits
    from stages.sandbox.rewards import RewardSetupError, check_rewards
    from stages.sandbox.tools import check_tools

    check_estimator_fits(config)
    try:
        train, test = validate_sources(config.data)
        specs = train.column("reward_spec").to_pylist() + test.column("reward_spec").to_pylist()
        check_rewards(config.score, {json.loads(spec)["kind"] for spec in specs})
        check_tools(config.generate.multi_turn)
    except (DataError, RewardSetupError) as error:
        raise ConfigError(str(error)) from None
    from flows.trackers import check_trackers

    check_trackers(config.log)  # a tracker library missing here is exit 2 now, not a warning per iteration


def _check_model(config: RunConfig) -> None:
    """The model resolves on this machine as the base_model stage will resolve it (a local directory; a hub id
    from the cache, else downloaded), so a model that is not there is refused before the run exists. Skipped
    for the packaged default (a dependency; converting it is the stage's work) and where stages run on
    deployed workers, which resolve it themselves."""
    from flows.runner.process import resolve_dispatch
    from stages.generation.models import DEFAULT_MODEL, ModelError, resolve_model

    if config.model.name_or_path == DEFAULT_MODEL or resolve_dispatch(None) != "local":
        return
    try:
        resolve_model(config.model)
    except ModelError as error:
        raise ConfigError(str(error)) from None


def _kept_nothing(run: Run) -> bool:
    """Whether the run holds nothing worth resuming: no base model resolved (at most the prompts table)."""
    from storage.layout import BASE, manifest_path_for

    return not run.fs.exists(manifest_path_for(run.layout.checkpoint_dir(BASE), "checkpoint"))


def _library_log_environment(run: Run, verbose: bool) -> dict[str, str]:
    """Where vLLM's own log lines go, for every process this one starts: with `verbose` the console as well
    (RLPIPE_VERBOSE=1); otherwise each engine stage's log file (stages/harness.py), and what vLLM logs while the
    stage server imports it in `logs/stage-server.log`."""
    from stages.generation.vllm_backend import vllm_logging_config

    if verbose:
        return {settings.VERBOSE.name: "1"}
    config_path = vllm_logging_config(run.layout.log_path("stage-server"))
    return {"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": str(config_path)}


def _drive(run: Run, debug: bool = False, new: bool = False, verbose: bool = False) -> int:
    """Run the loop flow on `run`; `new`: this command created the run, so a refusal before its base model
    removes it (a rerun then starts cleanly over instead of meeting the refused config)."""
    from flows.deploy import GroupReaper
    from storage.sharing import verify_run_shares

    verify_run_shares(run.layout)  # a fork's shared outputs, re-hashed: lost or changed ones are refused by name
    # Ends what this process started if it is killed (SIGTERM, SIGKILL): Prefect's temporary server, started by
    # Prefect with no tie to us, outlived a killed `rlpipe run` for good (2026-11-28). Released on a normal end,
    # where Prefect stops its server at exit.
    reaper = GroupReaper(follow_children=True)
    try:
        return _drive_flow(run, debug, new, verbose)
    finally:
        reaper.release()


def _drive_flow(run: Run, debug: bool, new: bool, verbose: bool) -> int:
    from flows.cli.status import status_table
    from flows.prefect_env import configure_prefect
    from flows.runner import forkserver
    from flows.runner.process import StageFailed, resolve_dispatch, stage_environment
    from storage.lock import RunLocked, run_lock

    with settings.environment(_library_log_environment(run, verbose)):
        if resolve_dispatch(None) == "local":
            # Started before Prefect is imported and its temporary server comes up, so that the stage server's
            # imports (torch, Great Expectations, vLLM: ~10 s) overlap them; the loop flow reuses it. Prefect's
            # variables are set first: the server's environment is the one every stage gets, so its libraries
            # load as the stages' would, and its preloaded rlpipe modules are reused (flows/runner/forkserver.py).
            configure_prefect()
            forkserver.start(stage_environment(run.config))
        try:
            with run_lock(run.layout):  # taken once, here: the flow is handed the run this process drives
                from flows.pipeline import loop_flow, quiet_stage_failures

                if not debug:
                    quiet_stage_failures()
                loop_flow(RunRef.driving(run))
        except RunLocked as error:
            _error(str(error))
            return 3
        except StageFailed as error:
            if new and error.returncode == 2 and _kept_nothing(run):  # the run lease is released by now
                run.fs.rm(run.layout.run_dir, recursive=True)
                _error(f"{error}; nothing was kept (run directory removed): fix it and run again")
                return 2
            _error(f"{error}; fix it and run `rlpipe resume {run.run_id}` to go on from there")
            return 2 if error.returncode == 2 else 1  # a stage's bad input is the run's bad input
        console.print(status_table(run))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.set)
    overrides = {"run_id": args.run_id, "iterations": args.iterations}
    values = config.model_dump(mode="json") | {k: v for k, v in overrides.items() if v is not None}
    config = parse_config(values, args.config or "<defaults>")
    _validate_data(config)
    _check_model(config)
    # the root: --root, else $RLPIPE_ROOT, else the config's
    layout = RunLayout.create(resolve_root(args.root, config), config.run_id)
    new = not layout.fs.exists(layout.config_path)
    return _drive(Run.start(config, args.root), args.debug, new, args.verbose)


def cmd_resume(args: argparse.Namespace) -> int:
    run = Run.open(args.root, args.run)
    if args.set:
        values = apply_overrides(run.config.model_dump(mode="json"), args.set)
        config = parse_config(values, f"{run.layout.config_path} with overrides {' '.join(args.set)}")
        _validate_data(config)
        _check_model(config)
        run = Run.start(config, run.root, replace_config=True)
    return _drive(run, args.debug, verbose=args.verbose)


def cmd_fork(args: argparse.Namespace) -> int:
    """A new run sharing RUN's outputs up to iteration K that its config leaves unchanged (flows/fork.py), then
    driven as `resume` drives a run. Its config is RUN's (or --config's) with the --set overrides and run id NEW."""
    from flows.fork import check_fork, fork

    source = Run.open(args.root, args.run)
    if args.config is not None:
        values, where = load_config(args.config, args.set).model_dump(mode="json"), str(args.config)
    else:
        values = apply_overrides(source.config.model_dump(mode="json"), args.set)
        where = f"{source.layout.config_path} with overrides {' '.join(args.set)}"
    config = parse_config(values | {"run_id": args.new}, where)
    check_fork(source, config, args.at)  # the cheap refusals before the data and model checks
    _validate_data(config)
    _check_model(config)
    forked = fork(source, config, args.at)
    shared = ", ".join(target.label for target in forked.shared) or "nothing"
    console.print(f"run {args.new} forked from {args.run} at iteration {args.at}: shares {shared}", soft_wrap=True,
                  markup=False, highlight=False)
    return _drive(forked.run, args.debug)


def cmd_status(args: argparse.Namespace) -> int:
    from flows.cli.status import status_table

    console.print(status_table(Run.open(args.root, args.run)))
    return 0


def cmd_stage(args: argparse.Namespace) -> int:
    import importlib

    from stages.harness import main as stage_main
    from stages.registry import STAGES

    if args.name not in STAGES:
        raise ConfigError(f"unknown stage {args.name!r}; stages are {', '.join(STAGES)}")
    module = importlib.import_module(f"stages.{args.name}")
    argv = ["--run", args.run, "--iter", str(args.iter), "--round", str(args.round), "--root", resolve_root(args.root)]
    return stage_main(args.name, module.run, argv)


def cmd_sandbox_serve(args: argparse.Namespace) -> int:
    from stages.sandbox.server import serve

    config = load_config(args.config, args.set)
    serve(config.score, host=args.host, port=args.port)
    return 0


def cmd_train_node(args: argparse.Namespace) -> int:
    """Node R >= 1 of a run's multi-node train stages: run its ranks of each train job, until Ctrl-C."""
    from stages.rl.deepspeed_backend import nodes_dir, serve_node

    run = Run.open(resolve_root(args.root), args.run)
    nodes = run.config.train.nodes
    if not 1 <= args.node_rank < nodes:
        raise ConfigError(f"--node-rank {args.node_rank}: run {args.run} trains on train.nodes={nodes} nodes, so "
                          f"the other nodes are 1..{nodes - 1} (node 0 runs the train stage itself)")
    directory = nodes_dir(run.layout.run_dir, run.run_id)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        serve_node(directory, args.node_rank)
    except KeyboardInterrupt:  # the ranks of a job being served were killed on the way out (run_launcher)
        return 130
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    import signal
    import time

    from flows import deploy

    # SIGTERM (a service manager, a test's teardown) and SIGHUP (a closed terminal) stop the children too, through
    # the `finally` below; whatever ends this process otherwise (SIGKILL), the children's parent-death signal and
    # the reaper end their process groups (flows/deploy.py).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(0))
    home = Path(args.home).expanduser().resolve()
    api_url = deploy.api_url_for(args.host, args.port)
    reaper = deploy.GroupReaper()
    processes = []
    try:
        server = reaper.watch(deploy.start_server(args.host, args.port, home, log_path=home / "server.log",
                                                  ui=not args.no_ui))
        processes.append(server)
        console.print(f"Prefect server starting at {api_url} (log {home / 'server.log'}) ...")
        deploy.wait_healthy(api_url, args.timeout, server)
        os.environ.update(PREFECT_API_URL=api_url, PREFECT_SERVER_EPHEMERAL_ENABLED="false")
        pools = deploy.pool_names(deploy.load_spec(args.prefect_file))
        deploy.ensure_work_pools(pools, "process")
        wanted = pools if args.workers == "all" else [p for p in args.workers.split(",") if p and p != "none"]
        # Workers run flows from this checkout; GPU stages one at a time (a process pool's resource is its machine).
        env = deploy.client_environment(api_url, extra={settings.HOME.name: str(deploy.REPO_ROOT)})
        for pool in wanted:
            limit = args.gpu_limit if pool == "gpu" else None
            processes.append(reaper.watch(deploy.start_worker(pool, env, log_path=home / f"worker-{pool}.log",
                                                              limit=limit)))
        console.print(f"[green]Prefect server ready[/]: export PREFECT_API_URL={api_url}")
        console.print(f"work pools: {', '.join(pools)}; workers here: {', '.join(wanted) or 'none'}; logs in {home}")
        if not args.no_ui:
            console.print(f"UI: {api_url.removesuffix('/api')}")
        console.print("next: `rlpipe deploy`; stop with Ctrl-C")
        while all(process.poll() is None for process in processes):
            time.sleep(1)
        _error(f"a child process exited; stopping (logs in {home})")
        return 1
    except KeyboardInterrupt:
        return 0
    except deploy.DeployError as error:
        _error(str(error))
        return 1
    finally:
        deploy.stop_processes(processes)
        reaper.close()


def cmd_deploy(args: argparse.Namespace) -> int:
    from flows import deploy
    from storage.fs import normalize_root

    api_url = args.api_url or os.environ.get("PREFECT_API_URL")
    if not api_url:
        raise ConfigError("no Prefect server: start one with `rlpipe server`, or pass --api-url / set PREFECT_API_URL")
    root = args.root or settings.ROOT.get()
    root = normalize_root(root) if root else None
    spec = deploy.render_spec(deploy.load_spec(args.prefect_file), args.run_id, root, args.every)
    if args.config:  # register the run in the storage root now, checked, so that the first trigger can run it
        if not (args.run_id and root):
            raise ConfigError("--config starts a run: give --run-id and --root with it")
        config = load_config(args.config, args.set)
        config = parse_config(config.model_dump(mode="json") | {"run_id": args.run_id}, str(args.config))
        _validate_data(config)
        Run.start(config, root)
    try:
        names = deploy.deploy(api_url, spec, args.pool_type)
    except deploy.DeployError as error:
        _error(str(error))
        return 1
    console.print(f"[green]deployed[/] {len(names)} deployments to {api_url}: {', '.join(sorted(names))}")
    if args.run_id:
        when = f"every {args.every:g}s" if args.every else "when triggered (no schedule)"
        console.print(f"iteration/advance advances run {args.run_id} at {root} by one iteration {when}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlpipe", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--root",
            help=f"storage root: a folder or s3://bucket/prefix (default $RLPIPE_ROOT, the config's root: or "
                 f"{settings.DEFAULT_ROOT})",
        )

    run = commands.add_parser("run", help="start (or continue) a run")
    run.add_argument("--config", type=Path, help="YAML config (default: built-in defaults)")
    run.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    run.add_argument("--run-id")
    run.add_argument("--iterations", type=int)
    run.add_argument("--debug", action="store_true", help="print Prefect's traceback of a failed stage too")
    run.add_argument("--verbose", action="store_true",
                     help="print vLLM's own log lines too (else only in each stage's log file, runs/RUN/logs/)")
    common(run)
    run.set_defaults(func=cmd_run)

    resume = commands.add_parser("resume", help="continue a run at its first unfinished stage")
    resume.add_argument("run")
    resume.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    resume.add_argument("--debug", action="store_true", help="print Prefect's traceback of a failed stage too")
    resume.add_argument("--verbose", action="store_true",
                        help="print vLLM's own log lines too (else only in each stage's log file, runs/RUN/logs/)")
    common(resume)
    resume.set_defaults(func=cmd_resume)

    fork = commands.add_parser("fork", help="a new run sharing another's outputs up to an iteration (docs/usage.md)")
    fork.add_argument("run", help="the run to fork from")
    fork.add_argument("new", help="the new run's id")
    fork.add_argument("--at", type=int, required=True, metavar="K", help="share outputs of iterations 0..K at most")
    fork.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                      help="override a field of the new run's config")
    fork.add_argument("--config", type=Path, help="the new run's config (default: RUN's)")
    fork.add_argument("--debug", action="store_true", help="print Prefect's traceback of a failed stage too")
    common(fork)
    fork.set_defaults(func=cmd_fork)

    status = commands.add_parser("status", help="iteration × stage table of a run")
    status.add_argument("run")
    common(status)
    status.set_defaults(func=cmd_status)

    stage = commands.add_parser("stage", help="run one stage in this process")
    stage.add_argument("name")
    stage.add_argument("--run", required=True)
    stage.add_argument("--iter", type=int, default=-1)
    stage.add_argument("--round", type=int, default=0, help="generation round (generate, score; dynamic sampling)")
    common(stage)
    stage.set_defaults(func=cmd_stage)

    sandbox = commands.add_parser("sandbox", help="the code sandbox")
    sandbox_commands = sandbox.add_subparsers(dest="sandbox_command", required=True)
    serve = sandbox_commands.add_parser("serve", help="serve the local sandbox under SandboxFusion's /run_code API")
    serve.add_argument("--config", type=Path)
    serve.add_argument("--set", action="append", default=[])
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.set_defaults(func=cmd_sandbox_serve)

    train_node = commands.add_parser(
        "train-node", help="be node R >= 1 of a run's multi-node train stages (train.nodes; docs/team.md)"
    )
    train_node.add_argument("run")
    train_node.add_argument("--node-rank", type=int, required=True, help="this machine's node rank, 1..nodes-1")
    common(train_node)
    train_node.set_defaults(func=cmd_train_node)

    default_spec = Path(__file__).resolve().parents[2] / "deployments" / "prefect.yaml"
    server = commands.add_parser(
        "server", help="a local Prefect server on 127.0.0.1 with the work pools and one worker per pool"
    )
    server.add_argument("--host", default="127.0.0.1", help="address to serve on (0.0.0.0 to let other machines in)")
    server.add_argument("--port", type=int, default=4200)
    server.add_argument("--home", default="~/.rlpipe/prefect", help="PREFECT_HOME of the server: database, logs")
    server.add_argument("--workers", default="all", metavar="POOLS",
                        help="comma-separated pools to start a worker for on this machine, 'all' or 'none'")
    server.add_argument("--gpu-limit", type=int, default=1, help="flow runs at once on this machine's gpu worker")
    server.add_argument("--no-ui", action="store_true", help="serve the API only")
    server.add_argument("--timeout", type=float, default=300, help="seconds to wait for the server to be healthy")
    server.add_argument("--prefect-file", type=Path, default=default_spec, help="the deployments file naming the pools")
    server.set_defaults(func=cmd_server)

    deploy = commands.add_parser("deploy", help="register deployments/prefect.yaml with a Prefect server")
    deploy.add_argument("--api-url", help="Prefect API (default $PREFECT_API_URL)")
    deploy.add_argument("--prefect-file", type=Path, default=default_spec)
    deploy.add_argument("--run-id", help="bind the scheduled `advance` deployment to this run (needs --root)")
    deploy.add_argument("--every", type=float, metavar="SECONDS", help="trigger `advance` on this interval")
    deploy.add_argument("--config", type=Path, help="start the run --run-id from this config in --root (checked now)")
    deploy.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    deploy.add_argument("--pool-type", default="process", help="worker type of pools that do not exist yet")
    deploy.add_argument("--root", help="storage root of the --run-id run (default $RLPIPE_ROOT): s3://... for a team")
    deploy.set_defaults(func=cmd_deploy)
    from flows.cli.inspect import add_inspect_commands

    add_inspect_commands(commands, common)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, InputError, InvalidRunId) as error:
        _error(str(error))
        return 2
    except OSError as error:  # an unwritable or full storage root: one line naming the path, no traceback
        from storage.fs import describe_os_error

        _error(f"storage error: {describe_os_error(error)}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
