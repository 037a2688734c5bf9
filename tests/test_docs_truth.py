"""What the docs and the code's own words claim, checked against the code where a test can check it.

- No measured figure in `sao/**/*.py` comments, docstrings or config descriptions: measurements
  rot there (and `sao config show` would print them); they belong in benchmarks/README.md.
- The README's claims about the CLI (which commands take `--config`/`--set`, which exist) and
  the defaults it quotes match the Typer app and `SaoConfig()`.
- Every config knob, metric, alert and repository path that README.md, docs/*.md,
  deploy/README.md or benchmarks/README.md names exists, and deploy/README.md lists every metric
  and every alert rule.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
import typing
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer
from pydantic import BaseModel

from sao.cli import app
from sao.config import SaoConfig

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# A number followed by a unit of measurement: the sign \u00d7 or x (a ratio), %, s.e., ns, µs, us, ms or s.
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*\s*(?:\u00d7|%|s\.e\.|(?:x|ns|µs|us|ms|s)(?!\w))")
# A figure right after one of these words is a setting or a limit, not a measurement ("Kafka's default is 45 s").
LIMIT = re.compile(r"(?:default|default is|default of|up to|at most|limit of|timeout of)\s*$", re.IGNORECASE)


def figures(text: str) -> list[str]:
    """The measured-looking figures in `text`, each with a little context."""
    found = []
    for match in FIGURE.finditer(text):
        if not LIMIT.search(text[max(0, match.start() - 20):match.start()]):
            found.append(text[max(0, match.start() - 30):match.end()].replace("\n", " "))
    return found


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment, docstring and literal `description=` string in a module."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                yield node.body[0].lineno, docstring
        elif isinstance(node, ast.keyword) and node.arg == "description":
            try:
                yield node.value.lineno, ast.literal_eval(node.value)
            except ValueError:  # an f-string or a name: nothing literal to read
                continue


def figures_in(source: str, name: str) -> list[str]:
    return [f"{name}:{line}: ...{figure}" for line, text in prose(source) for figure in figures(text)]


def test_the_figure_check_finds_figures_in_comments_docstrings_and_descriptions():
    bad = '''"""Loads in ~30 s."""
from pydantic import Field
x = Field(1, description="fused: 0.14 s vs 1.05 s; 1.73\u00d7 faster, 13 % sooner, 4.5 s.e.")
y = 2  # measured: 6 ms -> 0.3-0.9 ms per message, 3x the cost, 14 µs
def f():
    """Waits up to 10 s; Kafka's default is 45 s; 30 seconds; 64 steps; 2 x batch."""
'''
    found = figures_in(bad, "bad.py")
    # Each figure once; on line 6 the limit, the default and the bare units pass, and "2 x" (a ratio) does not.
    assert Counter(entry.split(":")[1] for entry in found) == {"1": 1, "3": 5, "4": 4, "6": 1}, found
    assert next(entry for entry in found if entry.startswith("bad.py:6:")).endswith("2 x")


def test_no_measured_figure_in_the_package_s_comments_docstrings_or_config_descriptions():
    found = [entry for path in sorted((ROOT / "sao").rglob("*.py"))
             for entry in figures_in(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], ("measured figures belong in benchmarks/README.md (leave a pointer: "
                         "'measured: benchmarks/README.md'):\n" + "\n".join(found))


def _commands(command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], set[str]]]:
    if hasattr(command, "list_commands"):
        for name in command.list_commands(None):
            yield from _commands(command.get_command(None, name), path + (name,))
    else:
        yield path, {option for param in command.params for option in getattr(param, "opts", [])}


COMMANDS = dict(_commands(typer.main.get_command(app)))


def test_the_readme_names_the_commands_that_do_not_take_config_and_set():
    sentence = re.search(r"Every command but (.+?) takes `--config FILE\.toml` and `--set section\.knob=value`",
                         " ".join(README.read_text().split()))
    assert sentence, "README: the sentence saying which commands take --config and --set is gone"
    claimed_without = set(re.findall(r"`([\w-]+)`", sentence.group(1)))
    without = {path[0] for path, options in COMMANDS.items() if not {"--config", "--set"} <= options}
    assert claimed_without == without
    # ... and every command of such a group lacks them (a group is named as a whole).
    for path, options in COMMANDS.items():
        assert ({"--config", "--set"} <= options) == (path[0] not in without), path


def test_the_readme_command_table_lists_every_command():
    table = {row.split("`")[1].split()[1].split("/")[0] for row in README.read_text().splitlines()
             if row.startswith("| `sao ")}
    assert table == {path[0] for path in COMMANDS}


def _default(dotted: str):
    value = SaoConfig()
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


# (what the README says, the config field it quotes, its default there)
QUOTED_DEFAULTS = [
    ("feeds 192 reasoning-gym arithmetic tasks (`run.num_tasks`)", "run.num_tasks", 192),
    ("feeds 192 reasoning-gym arithmetic tasks", "env.name", "arithmetic"),
    ("runs a sampler process (8 episodes side by side)", "sampler.num_samplers", 1),
    ("runs a sampler process (8 episodes side by side)", "sampler.rollout_batch", 8),
    ("on 80 held-out questions", "run.heldout_cap", 80),
    ("in the background on 48 other held-out questions", "trainer.shadow_tasks", 48),
    ("learning rate 1.5e-5, sampling temperature 0.7, shadow validation on", "trainer.learning_rate", 1.5e-5),
    ("learning rate 1.5e-5, sampling temperature 0.7, shadow validation on", "policy.temperature", 0.7),
    ("the launcher on 9700", "metrics.launcher_port", 9700),
    ("the trainer on 9701", "metrics.trainer_port", 9701),
    ("samplers from 9710 up", "metrics.sampler_port", 9710),
    ("a running mean per prompt by default", "trainer.baseline_key", "prompt"),
    ("(`min(\u03c1, clip)`, `trainer.objective`)", "trainer.objective.type", "tis"),
    ("scaled over the batch to unit root mean square but not centred", "trainer.scale_advantages", True),
    ("scaled over the batch to unit root mean square but not centred", "trainer.center_advantages", False),
    ("`freshness_decay ** staleness` (default 1)", "trainer.freshness_decay", 1.0),
    ("a right retry's answer is also taught to the first try", "trainer.retry_hindsight", True),
    ("in the first reply's own words", "trainer.hindsight_reply", "corrected"),
]


@pytest.mark.parametrize(("claim", "field", "value"), QUOTED_DEFAULTS, ids=[f for _, f, _ in QUOTED_DEFAULTS])
def test_a_default_the_readme_quotes_is_the_config_s_default(claim, field, value):
    assert claim in " ".join(README.read_text().split()), f"README no longer says {claim!r}: update this test"
    assert _default(field) == value, f"README says {claim!r}, but {field} defaults to {_default(field)!r}"


def test_the_broker_port_the_readme_quotes_is_the_cli_default():
    start = typer.main.get_command(app).get_command(None, "broker").get_command(None, "start")
    (port,) = [param for param in start.params if "--port" in param.opts]
    assert "`sao broker start/stop/status` | the embedded broker as a background process (`--port`, default 9092" \
        in README.read_text()
    assert port.default == 9092


def test_the_in_flight_default_the_docs_quote_is_the_feeder_s():
    from sao.feeder import in_flight_cap

    config = SaoConfig()
    batches = in_flight_cap(config) // config.trainer.batch_size
    design = " ".join((ROOT / "docs" / "design.md").read_text().split())
    scale_out = " ".join((ROOT / "docs" / "scale-out.md").read_text().split())
    assert f"`run.max_trajectories_in_flight` trajectories (default {batches} batches)" in design
    assert f"| tasks in flight | about {batches} \u00d7 `trainer.batch_size`" in scale_out


# --- names in the docs: every config knob, metric, alert and repository path a doc names exists -----------------

DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md", ROOT / "benchmarks" / "README.md"]
ALERT_RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
# `section.knob`, `section.sub.knob` (a knob's value or a method call after it is not part of the name).
KNOB = re.compile(rf"(?<![\w./-])(?:{'|'.join(SaoConfig.model_fields)})(?:\.\w+)+\*?(?![\w(])")
METRIC = re.compile(r"(?<![\w/.])sao_[a-z0-9_]+\*?(?!\w|\.[a-z])")  # not a file such as sao_state.json
ALERT = re.compile(r"\bSao[A-Z]\w*")
REPO_PATH = re.compile(r"(?<![\w./~$-])(?:\.\./)*(?:sao|tests|deploy|benchmarks|docs|\.ci)/[^\s`'\")\]|,;]*")
LINK = re.compile(r"\]\(([^)#\s]+)")
# Files a doc tells the user to make.
USER_MADE = {"deploy/.env"}
FILE_SUFFIXES = {"py", "md", "toml", "yml", "yaml", "json", "txt"}


def _models_of(annotation) -> list[type[BaseModel]]:
    """The config tables a field's annotation allows (several for a tagged union such as trainer.objective)."""
    return [candidate for candidate in (annotation, *typing.get_args(annotation))
            if isinstance(candidate, type) and issubclass(candidate, BaseModel)]


def _is_knob(dotted: str) -> bool:
    """`dotted` names a field of SaoConfig (a `prefix_*` names some); below a dict field anything goes."""
    models: list[type[BaseModel]] = [SaoConfig]
    *parents, last = dotted.split(".")
    for part in parents:
        if not models:
            return True
        fields = [model.model_fields[part] for model in models if part in model.model_fields]
        if not fields:
            return False
        models = [inner for field in fields for inner in _models_of(field.annotation)]
    if not models:
        return True
    names = {name for model in models for name in model.model_fields}
    if last.endswith("*"):
        return any(name.startswith(last.rstrip("*")) for name in names)
    return last in names


def _defined_metrics() -> set[str]:
    return set(re.findall(r'"(sao_[a-z0-9_]+)"', (ROOT / "sao" / "metrics.py").read_text()))


def _defined_alerts() -> set[str]:
    return set(re.findall(r"-\s*alert:\s*(\w+)", ALERT_RULES.read_text()))


def unknown_names(text: str, doc_dir: Path, metrics: set[str], alerts: set[str], classes: set[str]) -> list[str]:
    """What `text` (a doc in `doc_dir`) names that does not exist: knobs, metrics, alerts, repository paths."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for knob in KNOB.findall(line):
            placeholder = any(part.isupper() for part in knob.split(".")[1:])
            if not placeholder and knob.rsplit(".", 1)[-1] not in FILE_SUFFIXES and not _is_knob(knob):
                found.append(f"{number}: knob {knob}")
        for metric in METRIC.findall(line):
            series = re.sub(r"_(bucket|sum|count|created)$", "", metric)
            if metric.endswith("*"):
                known = any(name.startswith(metric.rstrip("*")) for name in metrics)
            else:
                known = metric in metrics or series in metrics
            if not known:
                found.append(f"{number}: metric {metric}")
        for alert in ALERT.findall(line):
            if alert not in alerts and alert not in classes:
                found.append(f"{number}: alert {alert}")
        paths = {path.split("#")[0].rstrip(".:") for path in REPO_PATH.findall(line)}
        paths |= {link for link in LINK.findall(line) if not link.startswith(("http:", "https:", "mailto:"))}
        for path in sorted(paths):
            placeholder = any(mark in path for mark in "*<>…{") or re.search(r"[A-Z]{3,}", path)
            if placeholder or path in USER_MADE or (ROOT / path).exists() or (doc_dir / path).exists():
                continue
            found.append(f"{number}: path {path}")
    return found


def test_the_name_check_finds_knobs_metrics_alerts_and_paths_that_do_not_exist():
    text = ("Set `trainer.learning_rate`, `trainer.lora.rank`, `trainer.shadow_*` and `env.options.turns` (fine),\n"
            "`trainer.learning_rat` and `policy.nope.deeper` (not), `trainer.KNOB` (a placeholder); see sampler.py.\n"
            "`sao_trainer_loss`, `sao_trainer_reward_bucket`, `sao_state.json`; `sao_trainer_los` is no metric.\n"
            "Alerts: `SaoTrainerStalled`, `SaoConfig` (a class), `SaoTrainerStaled`.\n"
            "Files: sao/config/trainer.py, [wire](docs/wire-format.md), `benchmarks/NAME.py`, sao/confg.py, [x](nowhere.md).\n")
    found = unknown_names(text, ROOT, {"sao_trainer_loss", "sao_trainer_reward"}, {"SaoTrainerStalled"}, {"SaoConfig"})
    assert found == ["2: knob trainer.learning_rat", "2: knob policy.nope.deeper", "3: metric sao_trainer_los",
                     "4: alert SaoTrainerStaled", "5: path nowhere.md", "5: path sao/confg.py"]


def test_every_knob_metric_alert_and_path_a_doc_names_exists():
    classes = set(re.findall(r"class (Sao\w+)", "".join(path.read_text() for path in (ROOT / "sao").rglob("*.py"))))
    metrics, alerts = _defined_metrics(), _defined_alerts()
    found = [f"{doc.relative_to(ROOT)}:{entry}" for doc in DOCS
             for entry in unknown_names(doc.read_text(), doc.parent, metrics, alerts, classes)]
    assert found == [], "docs name what does not exist (rename it, or fix the doc):\n" + "\n".join(found)


def test_deploy_readme_lists_every_metric_and_every_alert():
    deploy_readme = (ROOT / "deploy" / "README.md").read_text()
    alert_rows = set(re.findall(r"^\| `(Sao\w+)`(?: / `(Sao\w+)`)?", deploy_readme, flags=re.MULTILINE))
    in_table = {name for row in alert_rows for name in row if name}
    assert sorted(_defined_metrics() - set(METRIC.findall(deploy_readme))) == [], "deploy/README.md, Metrics"
    assert sorted(_defined_alerts() - in_table) == [], "deploy/README.md, Alerts: a rule without its row"
