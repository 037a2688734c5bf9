"""The `sao` command line: run, sampler, trainer, feed, topics, inspect, audit, eval, export, shadow, bench, broker,
config, compression.

Every flag maps onto one field of the typed config (`sao/config/`); `--set section.knob=value`
reaches any other field (every command but `broker` and `bench` takes `--config` and `--set`).
Flags win over `--set`, which wins over env vars and the TOML file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from sao.cli_options import ConfigOpt, SetOpt, config_or_exit, console, fail, setup_logging
from sao.config import ConfigError, SaoConfig, to_described_toml
from sao.offline.compression_cli import compression_app
from sao.run_dir import RunDir

# Each command imports what it runs inside its function: `sao` loads this module for every command, and
# torch, transformers and deepspeed take seconds to import (tests/test_cli_startup.py keeps them out).

app = typer.Typer(help="Asynchronous single-trajectory RL post-training through Kafka.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
broker_app = typer.Typer(help="The embedded Kafka-protocol broker (Tansu).", no_args_is_help=True)
config_app = typer.Typer(help="Inspect the effective configuration.", no_args_is_help=True)
app.add_typer(broker_app, name="broker")
app.add_typer(config_app, name="config")
app.add_typer(compression_app, name="compression")

BootstrapOpt = Annotated[str | None, typer.Option(help="Kafka bootstrap servers (default: broker.bootstrap_servers).")]
RunDirOpt = Annotated[Path | None, typer.Option(help="Run directory (logs, weights, checkpoints, summary).")]
MetricsPortOpt = Annotated[int | None, typer.Option(min=0, max=65535,
                                                    help="Port of this process's /metrics; 0 disables it.")]
RunConfigOpt = Annotated[Path | None, typer.Option("--config", "-c",
                                                  help="The run's TOML config (default: RUN_DIR/config.toml).")]
PolicyRunDirOpt = Annotated[Path | None, typer.Option(
    help="Run directory whose policy/ holds the versions; default: the newest under runs/.")]


def _check_env(cfg: SaoConfig) -> None:
    """Refuse a bad env.name or env.dataset_options with one line before a command makes any task."""
    from sao.envs.registry import UnknownEnv, check_env_config

    try:
        check_env_config(cfg.env)
    except (ConfigError, UnknownEnv) as err:
        fail(f"[red]config error:[/] {escape(str(err))}")


def _pin(cpus: list[int] | None) -> None:
    """Pin this process to `cpus` (validated to exist) before torch sizes its thread pools.

    The mask is per thread and inherited by threads created later; imports have already started
    a few, so every thread that exists now is pinned too.
    """
    if cpus is not None:
        for thread_id in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(thread_id), cpus)


def _serve_metrics(config: SaoConfig, port: int, role: str) -> None:
    from sao.observability import start_metrics_server

    start_metrics_server(config.metrics.host, port, role)


def _bootstrap(config: SaoConfig, flag: str | None) -> str:
    """The broker address to use, once a broker answers there within broker.connect_timeout_s; else exit 2."""
    bootstrap = flag or config.broker.bootstrap_servers
    if not bootstrap:
        fail("[red]no broker:[/] pass --bootstrap-servers or set broker.bootstrap_servers "
             "(or start one with `sao broker start`)")
    from sao.transport.broker import BrokerUnavailable, wait_until_ready

    try:
        wait_until_ready(bootstrap, config.broker.connect_timeout_s)
    except BrokerUnavailable:
        fail(f"[red]no broker answers at {escape(bootstrap)}[/] within broker.connect_timeout_s = "
             f"{config.broker.connect_timeout_s:g} s: start one (`sao broker start`) or pass the right "
             "address (--bootstrap-servers or broker.bootstrap_servers)")
    return bootstrap


def _run_dir(flag: Path | None, check: bool = True) -> Path:
    """--run-dir where given (with `check`, refused unless a run wrote there), else the newest run under runs/."""
    from sao.run_dir import RUNS, newest_run

    if flag is None:
        newest = newest_run()
        if newest is None:
            fail(f"[red]no run under {RUNS}/:[/] pass --run-dir (a folder `sao run` or `sao trainer` wrote)")
        console.print(f"run directory: {escape(str(newest.root))} (the newest under {RUNS}/; --run-dir picks another)",
                      soft_wrap=True)
        return newest.root
    if check and not RunDir(flag).holds_run():
        why = "it does not exist" if not flag.exists() else "no config.toml, status/, trained.jsonl or policy/ in it"
        fail(f"[red]--run-dir {escape(str(flag))} holds no run[/] ({why}): pass a folder `sao run` or "
             "`sao trainer` wrote")
    return flag


def _run_config(run_dir: Path, path: Path | None, sets: list[str] | None) -> SaoConfig:
    """`config_or_exit` over the run's own config.toml (its env, model and settings) unless --config names another."""
    if path is None and RunDir(run_dir).config.is_file():
        path = RunDir(run_dir).config
    return config_or_exit(path, sets)


@contextmanager
def _broker(config: SaoConfig, flag: str | None) -> Iterator[str]:
    """The address of a broker that answers (`_bootstrap`); if it fails mid-command: one line naming it, exit 3."""
    bootstrap = _bootstrap(config, flag)
    from confluent_kafka import KafkaException

    from sao.feeder import TasksNotAcknowledged
    from sao.transport.topics import TopicSetupError

    try:
        yield bootstrap
    except (KafkaException, TasksNotAcknowledged, TopicSetupError) as err:
        fail(f"[red]the broker at {escape(bootstrap)} failed:[/] {escape(str(err))}", 3)


@contextmanager
def _exit_when_broker_gone() -> Iterator[None]:
    """A lost or replaced broker ends `sao sampler` / `sao trainer` with its message and exit code 3."""
    from sao.transport.health import BrokerGone

    try:
        yield
    except BrokerGone as gone:
        fail(f"[red]broker gone:[/] {escape(str(gone))}", gone.exit_code)


@app.command()
def run(config: ConfigOpt = None, set_: SetOpt = None, run_dir: RunDirOpt = None,
        num_tasks: Annotated[int | None, typer.Option(help="run.num_tasks")] = None,
        minutes: Annotated[float | None, typer.Option(help="run.max_minutes: wall-clock budget")] = None,
        samplers: Annotated[int | None, typer.Option(help="sampler.num_samplers")] = None,
        model: Annotated[str | None, typer.Option(
            "--policy-model", "--model", help="policy.model: smollm2-135m-instruct, tiny or an HF model path")] = None,
        env: Annotated[str | None, typer.Option(help="env.name: a built-in or package.module:Class")] = None,
        bootstrap_servers: BootstrapOpt = None, metrics_port: MetricsPortOpt = None) -> None:
    """Run the whole loop: broker (embedded unless given), feeder, samplers, trainer; print a summary."""
    setup_logging()
    cfg = config_or_exit(config, set_, **{"run.run_dir": str(run_dir) if run_dir else None,
                                          "run.num_tasks": num_tasks, "run.max_minutes": minutes,
                                          "sampler.num_samplers": samplers, "policy.model": model, "env.name": env,
                                          "broker.bootstrap_servers": bootstrap_servers,
                                          "metrics.launcher_port": metrics_port})
    _check_env(cfg)
    if cfg.broker.bootstrap_servers:
        _bootstrap(cfg, None)
    _serve_metrics(cfg, cfg.metrics.launcher_port, "launcher")
    from confluent_kafka import KafkaException

    from sao.envs.registry import UnknownEnv
    from sao.feeder import TasksNotAcknowledged
    from sao.launcher import RunFailed
    from sao.launcher import run as run_loop
    from sao.transport.topics import TopicSetupError

    try:
        run_loop(cfg, console)
    except (RunFailed, UnknownEnv, TasksNotAcknowledged, TopicSetupError, KafkaException) as err:
        fail(f"[red]run failed:[/] {escape(str(err))}", 1)


@app.command()
def sampler(config: ConfigOpt = None, set_: SetOpt = None, bootstrap_servers: BootstrapOpt = None,
            sampler_id: Annotated[str, typer.Option(help="Name of this sampler in logs and trajectories.")] = "sampler-0",
            run_dir: RunDirOpt = None,
            max_tasks: Annotated[int | None, typer.Option(min=1, help="Exit after this many tasks.")] = None,
            metrics_port: MetricsPortOpt = None) -> None:
    """Consume tasks, roll out one trajectory each, compress, produce; reload new policies."""
    setup_logging()
    cfg = config_or_exit(config, set_, **{"metrics.sampler_port": metrics_port})
    _pin(cfg.sampler.cpu_affinity)
    _serve_metrics(cfg, cfg.metrics.sampler_port, "sampler")
    status = RunDir(run_dir).status(sampler_id) if run_dir else None
    if cfg.policy.transport.type == "kafka":  # weights come from the broker; only the key comes from disk
        from sao.transport.announcements import ANNOUNCE_KEY_NAME

        if cfg.sampler.announce_key_file is None and run_dir:  # the trainer's, on the machine it runs on
            cfg.sampler.announce_key_file = str(RunDir(run_dir).policy_dir / ANNOUNCE_KEY_NAME)
        if cfg.sampler.announce_key_file is None:
            fail("[red]no announcement key:[/] set sampler.announce_key_file to a copy of the trainer's "
                 "RUN_DIR/policy/.announce-key (or pass the trainer's --run-dir on its machine)")
    else:
        if cfg.sampler.policy_dir is None and run_dir:
            cfg.sampler.policy_dir = str(RunDir(run_dir).policy_dir)
        if cfg.sampler.policy_dir is None:  # it could never load a new version: refuse to start rather than go stale
            fail("[red]no policy folder:[/] pass --run-dir (its policy/ is used) or set sampler.policy_dir "
                 "to the folder the trainer publishes weights into (a shared mount on another machine), or "
                 "use policy.transport = 'kafka'")
    bootstrap = _bootstrap(cfg, bootstrap_servers)  # before the model libraries' seconds of imports
    from sao.sampler.loop import Sampler

    with _exit_when_broker_gone():
        Sampler(cfg, bootstrap, sampler_id, status).run(max_tasks)


@app.command()
def trainer(config: ConfigOpt = None, set_: SetOpt = None, bootstrap_servers: BootstrapOpt = None,
            run_dir: Annotated[Path, typer.Option(help="Weights, checkpoints and status go here.")] = Path("runs/trainer"),
            resume: Annotated[bool, typer.Option(help="Continue from the latest checkpoint in run-dir.")] = False,
            expect: Annotated[int | None, typer.Option(
                min=1, help="Exit after this many trajectories are handled.")] = None,
            metrics_port: MetricsPortOpt = None) -> None:
    """Consume trajectories and train the policy with DeepSpeed (ZeRO-3 across ranks); publish versions."""
    setup_logging()
    cfg = config_or_exit(config, set_, **{"metrics.trainer_port": metrics_port})
    _pin(cfg.trainer.cpu_affinity)
    # Rank 0 consumes, and records the all-reduced step figures: it alone speaks for the trainer.
    if int(os.environ.get("RANK", "0")) == 0:
        _serve_metrics(cfg, cfg.metrics.trainer_port, "trainer")
    bootstrap = _bootstrap(cfg, bootstrap_servers)  # before the model libraries' seconds of imports
    from sao.trainer.loop import Trainer

    with _exit_when_broker_gone():
        Trainer(cfg, bootstrap, run_dir, resume=resume).run(expect)


@app.command()
def feed(config: ConfigOpt = None, set_: SetOpt = None, bootstrap_servers: BootstrapOpt = None,
         num_tasks: Annotated[int | None, typer.Option(help="run.num_tasks")] = None,
         start_index: Annotated[int, typer.Option(min=0, help="First position of the train split.")] = 0) -> None:
    """Send tasks to the tasks topic."""
    setup_logging()
    cfg = config_or_exit(config, set_, **{"run.num_tasks": num_tasks})
    _check_env(cfg)
    from sao.feeder import feed_tasks

    with _broker(cfg, bootstrap_servers) as bootstrap:
        sent = feed_tasks(cfg, bootstrap, cfg.run.num_tasks, start_index)
    console.print(f"fed {sent} tasks to {cfg.topics.tasks}")


@app.command()
def topics(config: ConfigOpt = None, set_: SetOpt = None, bootstrap_servers: BootstrapOpt = None) -> None:
    """Create sao's topics (idempotent) with the configured partition counts."""
    cfg = config_or_exit(config, set_)
    from sao.transport.topics import ensure_topics, topic_partitions

    wanted = topic_partitions(cfg)
    with _broker(cfg, bootstrap_servers) as bootstrap:
        ensure_topics(bootstrap, wanted)
    console.print("topics ready: " + ", ".join(f"{name} ({parts})" for name, parts in wanted.items()))


StateDirOpt = Annotated[Path, typer.Option(help="Where the detached broker's pid/port file lives.")]


@broker_app.command("start")
def broker_start(port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port on 127.0.0.1.")] = 9092,
                 state_dir: StateDirOpt = Path(".sao/broker"),
                 storage: Annotated[str, typer.Option(
                     help="memory: lost when the broker stops. s3: kept on disk under STATE_DIR/s3 by a local S3 "
                          "server (pip install localbucket), survives a restart; see docs/reliability.md.")] = "memory",
                 ) -> None:
    """Start the embedded broker in the background."""
    from sao.transport.broker import start_detached

    if storage not in ("memory", "s3"):
        fail(f"[red]unknown storage {storage!r}:[/] use memory or s3")
    try:
        state = start_detached(state_dir, port, storage=storage)
    except FileNotFoundError as err:
        fail(f"[red]{escape(str(err))}[/]")
    console.print(f"broker running at [bold]{state['bootstrap']}[/] (pid {state['pid']}, "
                  f"{state.get('storage', 'memory')} storage); use --bootstrap-servers {state['bootstrap']}")
    if storage == "s3":  # its fetches list the bucket: a short fetch wait can starve a consumer
        console.print("with s3 storage, run clients with --set broker.fetch_wait_ms=100 (docs/reliability.md)")


@broker_app.command("stop")
def broker_stop(state_dir: StateDirOpt = Path(".sao/broker")) -> None:
    """Stop the broker started by `sao broker start`."""
    from sao.transport.broker import stop_detached

    console.print("broker stopped" if stop_detached(state_dir) else "no broker was running")


@broker_app.command("status")
def broker_status_cmd(bootstrap_servers: Annotated[str, typer.Option(help="Broker to ask.")] = "127.0.0.1:9092") -> None:
    """Is a broker reachable, and which topics does it hold?"""
    from sao.transport.broker import broker_status

    status = broker_status(bootstrap_servers)
    if not status["reachable"]:
        fail(f"[red]no broker answers at {bootstrap_servers}[/]", 1)
    table = Table("topic", Column("partitions", justify="right"), title=f"broker {bootstrap_servers}")
    for name, partitions in sorted(status["topics"].items()):
        table.add_row(name, str(partitions))
    Console().print(table)


@app.command()
def inspect(what: Annotated[str, typer.Argument(help="trajectories | dlq | policy")] = "trajectories",
            config: ConfigOpt = None, set_: SetOpt = None, bootstrap_servers: BootstrapOpt = None,
            limit: Annotated[int, typer.Option(min=1, help="Rows to show at most.")] = 20) -> None:
    """Show what a topic holds, decoded, as a table."""
    cfg = config_or_exit(config, set_)
    from sao.inspection import inspect_topic

    if what not in ("trajectories", "dlq", "policy"):
        fail(f"[red]unknown topic kind {what!r}[/]: use trajectories, dlq or policy")
    with _broker(cfg, bootstrap_servers) as bootstrap:
        table = inspect_topic(cfg, bootstrap, what, limit)
    Console().print(table)


@app.command()
def audit(run_dir: Annotated[Path, typer.Option(help="Run directory whose trained.jsonl and checkpoints/ to read.")],
          config: ConfigOpt = None, set_: SetOpt = None, bootstrap_servers: BootstrapOpt = None,
          finished: Annotated[bool | None, typer.Option(
              "--finished/--running", help="Is the run over (then what is in flight counts as lost)? "
                                           "Default: as the trainer's status file says.")] = None,
          json_path: Annotated[Path | None, typer.Option("--json", help="Also write the report here, as JSON.")] = None,
          read_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds to read each topic at most.")] = 300.0,
          quiet_s: Annotated[float, typer.Option(
              min=0.1, help="A topic is read to its end once it stays quiet this long.")] = 2.0) -> None:
    """Account for every task copy fed: trained once, dead-lettered, in flight, lost, or trained twice.

    Exits 1 if anything is lost or trained twice. Reads the topics, so the broker must still hold
    them (`sao run` stops its embedded broker at the end: audit runs on an external one).
    """
    run_dir = _run_dir(run_dir)
    cfg = config_or_exit(config, set_)
    from sao.audit import audit as audit_run
    from sao.audit import report_table, write_json

    with _broker(cfg, bootstrap_servers) as bootstrap:
        report = audit_run(cfg, RunDir(run_dir), bootstrap, finished, read_timeout, quiet_s)
    Console().print(report_table(report))
    if json_path is not None:
        write_json(report, json_path)
    if not report.clean:
        fail("[red]audit failed:[/] something was lost or trained twice (see the table)", 1)


@app.command("eval")
def eval_(config: RunConfigOpt = None, set_: SetOpt = None, run_dir: PolicyRunDirOpt = None,
          version: Annotated[str, typer.Option(
              help="Policy version to score: N (0 = the base model) or `best`, the version shadow validation "
                   "kept (RUN_DIR/shadow/board.json).")] = "0",
          num_tasks: Annotated[int, typer.Option(min=1, help="Distinct held-out tasks to score, at most.")] = 32,
          greedy: Annotated[bool, typer.Option(help="Greedy actions (default) or sampled at policy.temperature.")] = True,
          baseline: Annotated[int | None, typer.Option(
              min=0, help="Also score this earlier version (0 = the base model, cached) on the same tasks, greedily, and "
                   "report the paired first-try gain; writes RUN_DIR/eval/heldout.json.")] = None,
          ) -> None:
    """Score one policy version on distinct held-out tasks (the env's eval split); writes RUN_DIR/eval/vN.json."""
    setup_logging()
    run_dir = _run_dir(run_dir)
    cfg = _run_config(run_dir, config, set_)
    _check_env(cfg)
    from sao.policy.weights import WeightsMismatch
    from sao.sampler.evaluation import best_version, compare, evaluate

    try:
        version = best_version(run_dir) if version == "best" else _version_number(version)
        if baseline is None:
            result = evaluate(cfg, run_dir, version, num_tasks, greedy)
            keys = ("tasks", "first_try_success", "first_try_stderr", "second_try_success", "second_try_stderr",
                    "second_try_n", "second_try_penalised", "reward_mean", "env_failures", "seconds")
        else:
            result = compare(cfg, run_dir, version, baseline, cap=num_tasks)
            keys = ("heldout_n", "heldout_base", "heldout_final", "heldout_gain", "heldout_gain_stderr",
                    "heldout_second_try_base", "heldout_second_try_base_n", "heldout_second_try_final",
                    "heldout_second_try_n", "heldout_second_try_penalised_base", "heldout_second_try_penalised_final",
                    "heldout_reward_base", "heldout_reward_final", "base_cached", "base_seconds", "final_seconds")
    except (FileNotFoundError, ValueError, WeightsMismatch) as err:
        fail(f"[red]{err}[/]")
    table = Table(title=f"policy v{version}" + (f" vs v{baseline}" if baseline is not None else "")
                  + f" on up to {num_tasks} held-out tasks")
    for key in keys:
        value = result[key]
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    Console().print(table)


@app.command()
def replay(run_dir: Annotated[Path, typer.Argument(help="The run directory whose trajectory-log.bin to replay.")],
           set_: SetOpt = None,
           out: Annotated[Path | None, typer.Option(
               help="Write each rebuilt version here; with --set, instead of checking it.")] = None) -> None:
    """Rebuild every published version from the base weights and the run's trajectory log, no broker; each is
    checked against the run's state_sha256, and the first difference ends it (exit 1) naming step and tensor."""
    setup_logging()
    from sao.trainer.archive import ArchiveError, TrajectoryLog
    from sao.trainer.replay import CannotReplay, Replay, ReplayMismatch

    try:
        ranks = TrajectoryLog.read(RunDir(run_dir).trajectory_log).world_size()
        if ranks > 1 and "WORLD_SIZE" not in os.environ:  # each rank of the run replays as itself:
            from sao.transport.broker import free_port  # this same command again, under torch.distributed.run

            command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                       str(free_port()), "-m", "sao.cli", *sys.argv[1:]]
            raise typer.Exit(subprocess.run(command, check=False).returncode)
        result = Replay(run_dir, set_, out).run()
    except (ConfigError, ArchiveError, CannotReplay) as err:
        fail(f"[red]cannot replay:[/] {escape(str(err))}")
    except ReplayMismatch as err:
        fail(f"[red]replay mismatch:[/] {escape(str(err))}", 1)
    if os.environ.get("RANK", "0") != "0":
        return  # rank 0 says it for all
    checked = f"{result.checked} of {result.versions} versions match the run's hashes" if result.checked else \
        f"{result.versions} versions rebuilt (not checked: another setting)"
    console.print(f"replayed {result.steps} steps in {result.seconds:.1f} s: {checked}"
                  + (f"; written to {out}" if out is not None else ""))


@app.command()
def export(out: Annotated[Path, typer.Option(help="Folder to write (new or empty): an HF model folder.")],
           run_dir: PolicyRunDirOpt = None,
           version: Annotated[str, typer.Option(
               help="best (the version shadow validation kept), final (the newest published) or a version "
                    "number (0 = the base model).")] = "best",
           config: RunConfigOpt = None, set_: SetOpt = None) -> None:
    """Write a published version as a plain Hugging Face model folder: deltas applied, LoRA adapters merged,
    tokenizer included; the memory projector beside it (sao-memory.safetensors)."""
    setup_logging()
    run_dir = _run_dir(run_dir)
    cfg = _run_config(run_dir, config, set_)
    from sao.policy.export import export_version
    from sao.policy.recipe import PolicyRecipe
    from sao.policy.weights import WeightsMismatch
    from sao.sampler.evaluation import best_version
    try:
        if version == "best":
            number = best_version(run_dir)
        elif version == "final":
            number = max(RunDir(run_dir).kept_versions(), default=0)
        else:
            number = _version_number(version, "`best` or `final`")
        facts = export_version(cfg, PolicyRecipe.from_config(cfg).for_sampling("cpu", "fp32"), run_dir, number, out)
    except (FileNotFoundError, FileExistsError, ValueError, WeightsMismatch) as err:
        fail(f"[red]{err}[/]")
    console.print(f"exported v{facts['version']} ({facts['dtype']}, {facts['parameters']:,} parameters"
                  f"{', LoRA merged' if facts['lora_merged'] else ''}) to {out}")


def _version_number(text: str, names: str = "`best`") -> int:
    """`--version`'s number; `names` are the other values the command takes, for the message."""
    if not text.isdigit():
        raise ValueError(f"--version must be a version number or {names}, not {text!r}")
    return int(text)


@app.command()
def shadow(config: ConfigOpt = None, set_: SetOpt = None,
           run_dir: Annotated[Path | None, typer.Option(
               help="The trainer's run directory; default: the newest under runs/.")] = None) -> None:
    """Score the policy versions the trainer asks for on the validation slice (the trainer starts it)."""
    setup_logging()
    run_dir = _run_dir(run_dir, check=False)  # the trainer starts it before its run folder may hold anything
    cfg = config_or_exit(config, set_)
    from sao.sampler.shadow import serve

    serve(cfg, run_dir)


# The benchmarks live beside the package in the repository (an editable install); a wheel has none.
BENCHMARKS_DIR = Path(__file__).resolve().parent.parent / "benchmarks"


def _benchmarks() -> dict[str, str]:
    """Name -> first docstring line of every benchmarks/NAME.py, read without importing it (imports are slow)."""
    import ast

    found = {}
    for path in sorted(BENCHMARKS_DIR.glob("*.py")):
        if not path.name.startswith("_"):
            docstring = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
            found[path.stem] = docstring.strip().splitlines()[0] if docstring.strip() else ""
    return found


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True,
                               "allow_interspersed_args": False})  # everything after NAME is the benchmark's
def bench(ctx: typer.Context,
          name: Annotated[str | None, typer.Argument(help="Benchmark to run (benchmarks/NAME.py); none: list them.")]
          = None) -> None:
    """Run benchmarks/NAME.py with this interpreter, passing on every argument after NAME (try NAME --help)."""
    if not BENCHMARKS_DIR.is_dir():
        fail(f"[red]no benchmarks folder at {BENCHMARKS_DIR}:[/] the benchmarks ship with the repository, "
             "not the wheel; install sao from a clone (pip install -e .) to run them")
    available = _benchmarks()
    if name is None or name not in available:
        if name is not None:
            console.print(f"[red]unknown benchmark {name!r}[/] (no {BENCHMARKS_DIR / (name + '.py')})")
        table = Table("NAME", "measures", title=f"benchmarks in {BENCHMARKS_DIR}: sao bench NAME [ARGS...]")
        for benchmark, summary in available.items():
            table.add_row(benchmark, summary)
        Console().print(table)
        raise typer.Exit(0 if name is None else 2)
    completed = subprocess.run([sys.executable, str(BENCHMARKS_DIR / f"{name}.py"), *ctx.args], check=False)
    raise typer.Exit(completed.returncode)


@config_app.command("show")
def config_show(config: ConfigOpt = None, set_: SetOpt = None,
                describe: Annotated[bool, typer.Option(help="Each knob's description above it.")] = False) -> None:
    """Print every knob of the effective config as TOML (unset ones as `# knob = (unset)`), then the generation
    settings the env fills in."""
    from sao.envs.registry import UnknownEnv, generation_settings

    cfg = config_or_exit(config, set_)
    typer.echo(to_described_toml(cfg, describe))
    try:
        settings = generation_settings(cfg)
    except UnknownEnv as err:
        raise typer.BadParameter(str(err), param_hint="env.name") from err
    typer.echo("# effective generation settings (policy.* where set, else the env's defaults):")
    for key, value in vars(settings).items():
        typer.echo(f"#   {key} = {value!r}")


def main() -> None:
    """The `sao` command: a mistyped flag or value is one line naming it (click's usage box is several)."""
    try:
        code = app(standalone_mode=False)
    except typer.Abort:
        raise SystemExit(130) from None
    except Exception as err:  # click's errors, whichever click typer vendors: they carry their message and code
        if not (hasattr(err, "format_message") and hasattr(err, "exit_code")):
            raise
        context = getattr(err, "ctx", None)
        if type(err).__name__ == "NoArgsIsHelpError" and context is not None:
            typer.echo(context.get_help(), err=True)
        else:
            command = context.command_path if context is not None else "sao"
            typer.echo(f"{command}: {err.format_message()} (see '{command} --help')", err=True)
        raise SystemExit(err.exit_code) from None
    raise SystemExit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
