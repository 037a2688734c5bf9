"""The run directory's layout: the one place that knows its folders and file names.

```
RUN_DIR/
  config.toml            the effective config of `sao run` (trainer-config.toml: the trainer's, for evals)
  summary.json report.md plots/
  logs/<process>.log     broker, trainer, sampler-N, shadow
  status/<process>.json  progress files (sao/status.py): trainer, trainer-rankN, sampler-N
  policy/policy-vNNNNNN.safetensors (+ .json sidecar with its sha256): the last kept versions
  policy/delta-vNNNNNN.safetensors: a version published as a sparse delta on an earlier one (+ .json sidecar)
  policy/best            a link to the best version's whole file (best-vNNNNNN.safetensors when it was a delta)
  policy/.announce-key   the key announcements are signed with (the trainer makes it, samplers read it)
  cluster-id             the Kafka cluster id at the run's first start: a resume elsewhere is refused
  checkpoints/           DeepSpeed checkpoints with sao's state (sao/trainer/checkpoint.py)
  trained.jsonl          the ledger: which trajectories each optimizer step trained on
  trajectory-log.bin     what the trainer consumed, each step's batch, rollbacks and published hashes
                         (sao/trainer/archive.py): what `sao replay` rebuilds the versions from
  eval/vNNNNNN.json      `sao eval` results (eval/heldout.json: base vs final and kept versions, paired)
  shadow/                shadow validation: request.json (the version to score next), vNNNNNN.json (its
                         scores), board.json (every score, the best version, drops and rollbacks),
                         snapshots/ (the optimizer state of the versions a rollback may return to)
```
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

_WEIGHTS_PREFIX = "policy-v"
_DELTA_PREFIX = "delta-v"
_BEST_PREFIX = "best-v"
CHECKPOINT_STATE = "sao_state.json"  # in each checkpoint tag's folder, beside DeepSpeed's files


def _at(*parts: str) -> property:
    """A fixed path under the run directory, as a read-only attribute."""
    return property(lambda self: self.root.joinpath(*parts))


@dataclass(frozen=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    config = _at("config.toml")  # the effective config of `sao run`
    summary = _at("summary.json")
    report = _at("report.md")
    plots = _at("plots")
    logs = _at("logs")
    status_dir = _at("status")
    trainer_config = _at("trainer-config.toml")  # the trainer's own, for the evaluations it starts
    checkpoints = _at("checkpoints")
    latest_checkpoint = _at("checkpoints", "latest")  # names the tag of the newest complete checkpoint
    ledger = _at("trained.jsonl")
    trajectory_log = _at("trajectory-log.bin")  # sao/trainer/archive.py, read by `sao replay`
    policy_dir = _at("policy")
    cluster_id = _at("cluster-id")  # the Kafka cluster this run was first started on
    heldout = _at("eval", "heldout.json")  # the paired held-out comparison that ends `sao run`
    shadow_dir = _at("shadow")
    shadow_request = _at("shadow", "request.json")  # trainer -> scorer: the one version to score next
    shadow_board = _at("shadow", "board.json")  # trainer: every score, the best version, drops, rollbacks
    shadow_snapshots = _at("shadow", "snapshots")  # rankN/vNNNNNN.safetensors: optimizer state a rollback restores
    best_weights = _at("policy", "best")  # a link to the best version's weights file (none while v0 is best)

    def recorded_cluster_id(self) -> str | None:
        """The Kafka cluster id recorded at the run's first start (None: none, as in runs from before it was)."""
        try:
            return self.cluster_id.read_text().strip() or None
        except OSError:
            return None

    def holds_run(self) -> bool:
        """Whether a run wrote here: `sao run`'s config, or a trainer's status, ledger or policy folder."""
        return any(path.exists() for path in self._run_marks())

    def started_at(self) -> float:
        """When the run here last wrote one of the files that mark a run (mtime); 0 without one."""
        return max((path.stat().st_mtime for path in self._run_marks() if path.exists()), default=0.0)

    def _run_marks(self) -> tuple[Path, ...]:
        return self.config, self.trainer_config, self.status_dir, self.ledger, self.policy_dir

    def log(self, process: str) -> Path:
        return self.logs / f"{process}.log"

    def status(self, process: str) -> Path:
        """Progress file of `process` ("trainer", "trainer-rank1", "sampler-0", ...)."""
        return self.status_dir / f"{process}.json"

    def weights(self, version: int) -> Path:
        return self.policy_dir / f"{_WEIGHTS_PREFIX}{version:06d}.safetensors"

    def weights_delta(self, version: int) -> Path:
        """A version published as a sparse delta on an earlier one (sao/policy/deltas.py)."""
        return self.policy_dir / f"{_DELTA_PREFIX}{version:06d}.safetensors"

    def best_export(self, version: int) -> Path:
        """A version published as a delta, written whole for RUN_DIR/policy/best to link to."""
        return self.policy_dir / f"{_BEST_PREFIX}{version:06d}.safetensors"

    def best_exports(self) -> list[Path]:
        return sorted(self.policy_dir.glob(f"{_BEST_PREFIX}*.safetensors"))

    def weights_sidecar(self, version: int) -> Path:
        """The announcement's facts (sha256 above all) beside the file, for readers without Kafka."""
        return self.weights(version).with_suffix(".json")

    def kept_versions(self) -> list[int]:
        """Versions whose weights (whole or a delta) are still on disk, oldest first."""
        return sorted({int(p.stem[len(prefix):]) for prefix in (_WEIGHTS_PREFIX, _DELTA_PREFIX)
                       for p in self.policy_dir.glob(f"{prefix}*.safetensors")})

    def eval_result(self, version: int) -> Path:
        return self.root / "eval" / f"v{version:06d}.json"

    def shadow_result(self, version: int) -> Path:
        return self.shadow_dir / f"v{version:06d}.json"

    def drop_weights(self) -> int:
        """Delete what only resuming or re-scoring needs (checkpoints, policy files, optimizer snapshots),
        keeping the figures (summary, status, logs, eval, shadow scores); returns the bytes freed.
        For benchmarks that run many whole runs and read only their figures."""
        freed = 0
        for folder in (self.checkpoints, self.policy_dir, self.shadow_snapshots):
            if folder.is_symlink():  # a folder kept elsewhere is not this run's to delete: drop the link only
                folder.unlink()
            elif folder.is_dir():
                freed += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
                shutil.rmtree(folder, ignore_errors=True)  # a file left behind must not cost the figures
        return freed

    def checkpoint_state(self, tag: str) -> Path:
        """sao's state of checkpoint `tag` (step, offsets, Kafka cluster id), JSON; see sao/trainer/checkpoint.py."""
        return self.checkpoints / tag / CHECKPOINT_STATE


RUNS = Path("runs")  # where `sao run` puts a run without run.run_dir: runs/<timestamp>


def newest_run(runs: Path = RUNS) -> RunDir | None:
    """The run under `runs` that wrote last (see RunDir.started_at); None where none holds a run."""
    found = [RunDir(folder) for folder in runs.iterdir() if folder.is_dir()] if runs.is_dir() else []
    found = [run for run in found if run.holds_run()]
    return max(found, key=RunDir.started_at, default=None)
