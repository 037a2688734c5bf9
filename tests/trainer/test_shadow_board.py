"""Shadow validation's verdicts (sao/trainer/shadow.py): the top and the best version, and a drop only
when the paired difference to the top is beyond the margin."""

import pytest

from sao.trainer.shadow import ShadowBoard, ShadowScore


def score(version: int, successes: list[int]) -> ShadowScore:
    return ShadowScore(version, {f"t{i}": float(s) for i, s in enumerate(successes)})


def test_the_best_is_the_highest_score_and_a_tie_goes_to_the_later_version():
    board = ShadowBoard(margin=2.0)
    assert board.add(score(0, [1, 0, 0, 0])) is None
    assert board.add(score(2, [1, 1, 0, 0])) is None
    assert board.best == 2
    assert board.add(score(4, [0, 1, 1, 0])) is None  # the same success: the later version is kept
    assert board.best == 4


def test_a_version_far_below_the_top_is_a_drop_and_one_within_noise_is_the_best():
    board = ShadowBoard(margin=2.0)
    board.add(score(0, [1] * 10 + [0] * 10))
    # One task fewer right: within noise (gap -0.05, stderr 0.05), so the newer version is kept.
    assert board.add(score(2, [1] * 9 + [0] * 11)) is None
    assert (board.top, board.best) == (0, 2)
    drop = board.add(score(4, [0] * 20))  # every right answer lost
    assert drop is not None and (drop.version, drop.top, drop.best) == (4, 0, 2)  # a rollback returns to v2
    assert drop.gap == pytest.approx(-0.5)
    assert drop.gap < -2.0 * drop.stderr
    assert board.drops == [drop] and board.best == 2
    # Later versions are still measured from the top, not from the best: a slide by steps within noise
    # each (v2, then v6 one task below v2) is a drop once it is beyond the margin from v0.
    assert board.add(score(6, [1] * 8 + [0] * 12)) is None and board.best == 6
    assert board.add(score(8, [1] * 3 + [0] * 17)) is not None and board.best == 6


def test_the_difference_is_paired_on_the_tasks_both_versions_were_scored_on():
    board = ShadowBoard(margin=2.0)
    board.add(score(0, [1, 1, 1, 1]))
    # Every shared task lost: no spread, a certain drop (not an unmeasurable one).
    drop = board.add(ShadowScore(2, {"t0": 0.0, "t1": 0.0, "other": 1.0}))
    assert drop is not None and drop.gap == -1.0 and drop.stderr == 0.0


def test_a_rollback_alias_takes_the_best_score_and_becomes_the_best():
    board = ShadowBoard(margin=2.0)
    board.add(score(0, [1, 1, 1, 1]))
    assert board.add(score(2, [0, 0, 0, 0])) is not None  # a drop: v0 stays the best, and a rollback returns there
    board.alias(3, same_as=0)
    assert board.best == board.top == 3 and board.to_json()["top"] == 3
    assert board.scores[3].mean == board.scores[0].mean and board.scores[3].same_as == 0
    summary = board.to_json()
    assert summary["best"]["version"] == 3 and summary["best"]["same_as"] == 0
    assert summary["scores"]["2"]["success"] == 0.0


def test_a_resumed_trainer_rebuilds_the_board_from_the_earlier_lives_scores(tmp_path):
    import json

    from sao.run_dir import RunDir
    from sao.trainer.shadow import earlier_board

    run_dir = RunDir(tmp_path)
    run_dir.shadow_dir.mkdir()
    for version, successes in ((0, [1, 1, 1, 1, 0, 0]), (2, [0, 0, 0, 0, 0, 0])):
        run_dir.shadow_result(version).write_text(json.dumps(
            {"version": version, "successes": {f"t{i}": s for i, s in enumerate(successes)}, "seconds": 1.0}))
    run_dir.shadow_result(4).write_text(json.dumps({"version": 4, "error": "its file was pruned"}))
    rollback = {"step": 3, "from_version": 2, "to_version": 0, "published_as": 3}
    run_dir.shadow_board.write_text(json.dumps({"scores": {"3": {"same_as": 0}}, "rollbacks": [rollback]}))

    board = earlier_board(run_dir, margin=2.0)
    assert sorted(board.scores) == [0, 2, 3]  # v4 could not be scored: not a score of 0
    assert board.best == 3 and board.scores[3].same_as == 0  # the rollback's republished best
    assert board.rollbacks == [rollback]
    assert len(board.drops) == 1  # v2 fell below v0 then, and still does
    # A later version is judged against the earlier lives' best, paired on the same tasks.
    assert board.add(score(5, [0, 0, 0, 0, 0, 0])) is not None


def test_a_verdict_does_not_wait_for_the_best_versions_whole_file(tmp_path, monkeypatch):
    """RUN_DIR/policy/best (a delta chain rebuilt whole: seconds) is written in the background; the step that
    reads the score goes on, and the run ends with the link on the best."""
    import threading
    from types import SimpleNamespace

    from sao.config import TrainerConfig
    from sao.run_dir import RunDir
    from sao.trainer import shadow_validation

    class OneScore:  # the scorer process, with one score ready
        pending, failed, cpu_s, peak_rss_mb, idle = 2, None, 1.0, None, False

        def poll(self):
            self.pending = None
            return score(2, [1, 0])

        def stop(self):
            pass

    release, linked = threading.Event(), []
    monkeypatch.setattr(shadow_validation, "link_best",
                        lambda run_dir, version: (release.wait(30), linked.append(version)))
    validation = shadow_validation.ShadowValidation(TrainerConfig(), RunDir(tmp_path), OneScore())
    assert validation.verdict(SimpleNamespace(device="cpu")) is None  # no drop, no rollback
    assert validation.board.best == 2 and linked == []  # the verdict came back while the link was being made
    release.set()
    validation.finish(2)
    validation.stop()
    assert linked[-1] == 2
