"""`sao trainer` with trajectory validation switched off, to test the net under it: what the scoring
path does with a trajectory that raises or a loss that is not finite. Usage: like `python -m sao.cli`."""

from sao.cli import app
from sao.trainer.validation import TrajectoryValidator

TrajectoryValidator.validate = lambda self, trajectory, policy_version: None

if __name__ == "__main__":
    app()
