"""`sao audit`: what became of every task copy ever fed, from the topics, the trainer's ledger and checkpoint.

Each task message fed (task_id + copy; its trajectory id is `Trajectory.make_id(task_id, copy)`)
ends in exactly one class:

- trained: in the trainer's surviving history, at most `trainer.max_reuse` times (once by default);
- trained twice: more often than that, which is a delivery bug;
- dead-lettered: its task or its trajectory is on the dead-letter topic (with the reason);
- in flight: produced and not trained yet, or not produced yet;
- lost: what would be in flight, once the run is over (`--finished`, or the trainer's status
  file says it stopped).

The ledger (RUN_DIR/trained.jsonl) lists each step's trajectory ids. A resumed trainer writes
`{"resumed_from_step": N}`: the steps after N of the life that crashed were rolled back with its
weights, so their trajectories count as not trained (the resumed life trains them again); only
the surviving history counts. Messages that decode as nothing are counted as undecodable, per
topic, and matched with their dead letters by source partition and offset.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Column, Table
from rich.text import Text

from sao.config import SaoConfig
from sao.dead_letters import NO_REASON
from sao.run_dir import RunDir
from sao.schema import Task, Trajectory
from sao.status import TrainerProgress, read_status
from sao.transport.dlq import describe_dlq_message, trajectory_id_of
from sao.transport.health import cluster_id_of
from sao.transport.kafka import iter_all

SHOWN_IDS = 20  # ids listed per class in the table; the JSON report has them all

Coordinates = tuple[str, int, int]  # topic, partition, offset


@dataclass
class Ledger:
    """The trainer's surviving history: what each step that still counts trained on."""

    steps: dict[int, list[str]] = field(default_factory=dict)
    resumes: int = 0
    restarts_without_resume: int = 0  # a step number again without a resume marker: fresh weights
    rolled_back_steps: int = 0
    undecodable_lines: int = 0

    def times_trained(self) -> Counter[str]:
        return Counter(tid for ids in self.steps.values() for tid in ids)


def read_ledger(path: Path) -> Ledger:
    """The surviving history in `path`: steps a resume (or a restart) threw away are cut."""
    ledger = Ledger()
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    for line in lines:
        record = _json_object(line)
        cut, step, ids = record.get("resumed_from_step"), record.get("step"), record.get("trajectory_ids")
        if _is_count(cut):
            ledger.resumes += 1
            _cut_after(ledger, cut)
        elif _is_count(step) and isinstance(ids, list) and all(isinstance(tid, str) for tid in ids):
            if ledger.steps and step <= max(ledger.steps):
                ledger.restarts_without_resume += 1
                _cut_after(ledger, step - 1)
            ledger.steps[step] = ids
        else:
            ledger.undecodable_lines += 1
    return ledger


def _cut_after(ledger: Ledger, step: int) -> None:
    for abandoned in [s for s in ledger.steps if s > step]:
        del ledger.steps[abandoned]
        ledger.rolled_back_steps += 1


@dataclass
class TopicScan:
    """Everything the three topics say, by trajectory id where a message decodes to one."""

    fed: Counter[str] = field(default_factory=Counter)  # task messages per copy (a re-fed one counts twice)
    produced: Counter[str] = field(default_factory=Counter)
    dead_lettered: dict[str, str] = field(default_factory=dict)  # trajectory id -> reason of its first dead letter
    undecodable: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # topic -> (partition, offset)
    dead_lettered_at: dict[Coordinates, str] = field(default_factory=dict)  # undecodable source -> reason


def scan_topics(config: SaoConfig, bootstrap: str, timeout: float, quiet_period: float) -> TopicScan:
    """Read the tasks, trajectories and dead-letter topics from the beginning."""
    topics, scan = config.topics, TopicScan()
    for topic, kind, counts in ((topics.tasks, Task, scan.fed), (topics.trajectories, Trajectory, scan.produced)):
        for msg in iter_all(bootstrap, topic, timeout, quiet_period):
            tid = trajectory_id_of(msg.value(), kind)
            if tid is None:
                scan.undecodable.setdefault(topic, set()).add((msg.partition(), msg.offset()))
            else:
                counts[tid] += 1
    kinds = {topics.tasks: Task, topics.trajectories: Trajectory}
    for msg in iter_all(bootstrap, topics.dlq, timeout, quiet_period):
        letter = describe_dlq_message(msg)
        reason, source = letter["reason"] or NO_REASON, letter["source_topic"]
        tid = trajectory_id_of(msg.value(), kinds[source]) if source in kinds else None
        if tid is not None:
            scan.dead_lettered.setdefault(tid, reason)
        elif source is not None and letter["source_partition"] is not None and letter["source_offset"] is not None:
            scan.dead_lettered_at[(source, letter["source_partition"], letter["source_offset"])] = reason
        else:
            scan.undecodable.setdefault(topics.dlq, set()).add((msg.partition(), msg.offset()))
    return scan


@dataclass
class AuditReport:
    finished: bool
    max_reuse: int
    fed: int  # task copies fed (distinct trajectory ids)
    fed_messages: int
    trained: int
    trained_twice: dict[str, int]  # id -> times trained in the surviving history
    dead_lettered: dict[str, int]  # reason -> copies
    in_flight_produced: list[str]  # produced, not trained or dead-lettered yet
    in_flight_not_produced: list[str]
    lost_produced: list[str]  # the same two, once the run is over
    lost_not_produced: list[str]
    undecodable: dict[str, dict[str, int]]  # topic -> {"messages", "dead_lettered"}
    not_fed: int  # produced or trained, yet no task message says it was fed
    trained_after_checkpoint: int  # in steps after the latest checkpoint: a crash now means training them again
    checkpoint_step: int | None
    ledger: dict[str, int]
    notes: list[str]
    # Fed task copies the run's own records count (its feeder's status, its ledger) that the topics read here
    # do not hold: the broker lost them, or it is not the run's cluster (`foreign_cluster` says which it is).
    unaccounted: int = 0
    foreign_cluster: str | None = None

    @property
    def clean(self) -> bool:
        """Nothing lost (an undecodable message nobody dead-lettered included), nothing trained twice, and the
        broker read is the run's own and holds everything the run fed."""
        lost_undecodable = self.finished and any(u["messages"] > u["dead_lettered"] for u in self.undecodable.values())
        return not (self.trained_twice or self.lost_produced or self.lost_not_produced or lost_undecodable
                    or self.unaccounted or self.foreign_cluster)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "clean": self.clean}


def audit(config: SaoConfig, run_dir: RunDir, bootstrap: str, finished: bool | None = None, timeout: float = 300.0,
          quiet_period: float = 2.0) -> AuditReport:
    """Account for every fed task copy; `finished` None: as the trainer's status file says."""
    scan = scan_topics(config, bootstrap, timeout, quiet_period)
    ledger = read_ledger(run_dir.ledger)
    checkpoint = _latest_checkpoint_state(run_dir)
    finished = TrainerProgress.read(run_dir.status("trainer")).finished if finished is None else finished
    report = classify(scan, ledger, checkpoint, finished, config.trainer.max_reuse, config.topics.dlq)
    current = cluster_id_of(bootstrap)
    for recorded, where in ((run_dir.recorded_cluster_id(), f"the run started on ({run_dir.cluster_id.name})"),
                            ((checkpoint or {}).get("broker_cluster_id"), "the checkpoint was taken against")):
        if recorded and current != recorded and report.foreign_cluster is None:
            report.foreign_cluster = recorded
            report.notes.append(f"the broker read here is Kafka cluster {current!r}, not {recorded!r}, which {where}: "
                                "these topics are not the run's log (a restarted in-memory broker?)")
    # Task copies the run itself says it fed: what its feeder counted (`sao run`), at least what it trained.
    fed = read_status(run_dir.status("feeder")).get("fed")
    fed_by_run = max(fed if _is_count(fed) else 0, len(ledger.times_trained()))
    report.unaccounted = fed_by_run if report.foreign_cluster else max(0, fed_by_run - report.fed)
    if report.unaccounted:
        report.notes.append(f"the broker cannot account for {report.unaccounted} of the {fed_by_run} task copies the "
                            "run fed (its feeder's status and its ledger): they are lost with the broker's log")
    return report


def classify(scan: TopicScan, ledger: Ledger, checkpoint: dict[str, Any] | None, finished: bool, max_reuse: int,
             dlq_topic: str) -> AuditReport:
    """Put each fed copy in its class (a trained one counts as trained even if it was also dead-lettered)."""
    times = ledger.times_trained()
    trained, trained_twice, dead = 0, {}, Counter()
    waiting: dict[bool, list[str]] = {True: [], False: []}  # produced? -> ids neither trained nor dead-lettered
    for tid in sorted(scan.fed):
        if times[tid] > max_reuse:
            trained_twice[tid] = times[tid]
        elif times[tid]:
            trained += 1
        elif tid in scan.dead_lettered:
            dead[scan.dead_lettered[tid]] += 1
        else:
            waiting[tid in scan.produced].append(tid)
    checkpoint_step = checkpoint.get("step") if checkpoint else None
    after = ({tid for step, ids in ledger.steps.items() if step > checkpoint_step for tid in ids}
             if _is_count(checkpoint_step) else set())
    unfed = (set(times) | set(scan.produced)) - set(scan.fed)
    notes = []
    if unfed:
        notes.append(f"{len(unfed)} trajectories were produced or trained without a task message on the tasks topic "
                     "(fed elsewhere, or the topic no longer holds them)")
    if ledger.restarts_without_resume:
        notes.append(f"the ledger starts its step numbers again {ledger.restarts_without_resume} time(s) without a "
                     "resume marker (a trainer started afresh in this run directory): earlier steps count as undone")
    return AuditReport(
        finished=finished, max_reuse=max_reuse, fed=len(scan.fed), fed_messages=sum(scan.fed.values()),
        trained=trained, trained_twice=trained_twice, dead_lettered=dict(dead),
        in_flight_produced=[] if finished else waiting[True], in_flight_not_produced=[] if finished else waiting[False],
        lost_produced=waiting[True] if finished else [], lost_not_produced=waiting[False] if finished else [],
        undecodable=_undecodable(scan, dlq_topic), not_fed=len(unfed), trained_after_checkpoint=len(after),
        checkpoint_step=checkpoint_step,
        ledger={"steps": len(ledger.steps), "resumes": ledger.resumes, "rolled_back_steps": ledger.rolled_back_steps,
                "undecodable_lines": ledger.undecodable_lines}, notes=notes)


def _undecodable(scan: TopicScan, dlq_topic: str) -> dict[str, dict[str, int]]:
    counts = {}
    for topic, where in sorted(scan.undecodable.items()):
        # A dead letter's own bytes or headers being garbage leaves nothing to match it with.
        dead = 0 if topic == dlq_topic else sum((topic, p, o) in scan.dead_lettered_at for p, o in where)
        counts[topic] = {"messages": len(where), "dead_lettered": dead}
    return counts


def report_table(report: AuditReport) -> Table:
    """The counts as a rich table, with the ids of anything lost or trained twice (the first SHOWN_IDS)."""
    state = "finished" if report.finished else "running (nothing counts as lost yet)"
    table = Table("class", Column("copies", justify="right"), "ids / detail",
                  title=f"audit of {report.fed} fed task copies ({report.fed_messages} messages); run {state}")
    table.add_row("trained" + (" exactly once" if report.max_reuse == 1 else f" (<= {report.max_reuse} times)"),
                  str(report.trained), f"{report.trained_after_checkpoint} after the latest checkpoint "
                                       f"(step {report.checkpoint_step})" if report.trained_after_checkpoint else "")
    table.add_row("trained twice" + ("" if report.max_reuse == 1 else f" (> {report.max_reuse} times)"),
                  str(len(report.trained_twice)), _ids(report.trained_twice), style="red" if report.trained_twice else None)
    for reason, count in sorted(report.dead_lettered.items()):
        table.add_row(f"dead-lettered: {reason}", str(count), "")
    table.add_row("in flight: produced, not trained", str(len(report.in_flight_produced)), "")
    table.add_row("in flight: not produced", str(len(report.in_flight_not_produced)), "")
    for label, ids in (("lost: produced, never trained", report.lost_produced),
                       ("lost: never produced", report.lost_not_produced)):
        table.add_row(label, str(len(ids)), _ids(ids), style="red" if ids else None)
    for topic, counts in report.undecodable.items():
        table.add_row(f"undecodable on {topic}", str(counts["messages"]), f"{counts['dead_lettered']} dead-lettered")
    ledger = report.ledger
    table.add_row("ledger", str(ledger["steps"]), f"steps; {ledger['resumes']} resumes, {ledger['rolled_back_steps']} "
                  f"rolled-back steps, {ledger['undecodable_lines']} undecodable lines")
    if report.unaccounted:
        table.add_row("lost: not on this broker", str(report.unaccounted), "fed by the run, not in these topics",
                      style="red")
    for note in report.notes:
        table.add_row("note", "", Text(note))
    return table


def write_json(report: AuditReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(), indent=2))


def _ids(ids) -> Text:
    shown = sorted(ids)[:SHOWN_IDS]
    more = f" ... and {len(ids) - SHOWN_IDS} more" if len(ids) > SHOWN_IDS else ""
    return Text(", ".join(shown) + more)  # Text: ids are shown literally, never as rich markup


def _latest_checkpoint_state(run_dir: RunDir) -> dict[str, Any] | None:
    try:
        tag = run_dir.latest_checkpoint.read_text().strip()
        state = json.loads(run_dir.checkpoint_state(tag).read_text()) if tag and Path(tag).name == tag else None
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _json_object(line: str) -> dict[str, Any]:
    try:
        record = json.loads(line)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
