"""The trainer's progress (`TrainerProgress`): each question it answers, and its round trip through the file."""

from sao.status import TrainerProgress, write_status

# Earlier lives handled 10; this life accepted 6 (2 still buffered) and dead-lettered 3, one of them after
# accepting it (so counted once); samplers dead-lettered 1 task whose trajectory never came.
PROGRESS = TrainerProgress(step=3, policy_version=3, trajectories_trained=3, consumed=6, duplicates=2, dead_lettered=3,
                           dead_lettered_from_buffer=1, too_stale=1, tasks_dead_lettered=1, handled_before_start=10,
                           buffered=2, dlq_reasons={"too-stale": 1, "decode-error": 2},
                           task_dlq_reasons={"env-error": 1})


def test_a_message_dead_lettered_after_it_was_accepted_counts_once():
    assert PROGRESS.handled == 10 + 6 + 3 - 1


def test_a_dead_lettered_task_is_done_with_though_its_trajectory_never_comes():
    assert PROGRESS.done_with == PROGRESS.handled + 1


def test_all_handled_once_the_expected_count_is_done_with_and_never_without_an_expectation():
    assert PROGRESS.all_handled(19)
    assert not PROGRESS.all_handled(20)
    assert not PROGRESS.all_handled(None)
    assert not TrainerProgress().all_handled(None)


def test_done_only_once_the_buffer_is_empty_too():
    assert not PROGRESS.done(19)  # two trajectories still wait in the buffer
    assert TrainerProgress(consumed=4, buffered=0).done(4)
    assert not TrainerProgress(consumed=4, buffered=0).done(None)


def test_a_released_batch_is_handled_when_the_count_done_with_is_a_whole_multiple_and_something_waits():
    assert PROGRESS.released_batch_handled(19)
    assert not PROGRESS.released_batch_handled(4)  # 19 done with: part of the batch is still coming
    assert TrainerProgress(consumed=8, buffered=3).released_batch_handled(4)
    assert not TrainerProgress(consumed=8, buffered=0).released_batch_handled(4)  # nothing to train


def test_a_checkpoint_stores_what_is_handled_less_what_a_resume_reads_again():
    assert PROGRESS.settled == PROGRESS.handled - 2
    assert PROGRESS.handled_since(PROGRESS.settled - 1)
    assert not PROGRESS.handled_since(PROGRESS.settled)


def test_the_feeder_counts_a_buffered_trajectory_as_still_in_flight():
    # Trained, dead-lettered by the trainer, dead-lettered as a task; not consumed nor earlier lives.
    assert PROGRESS.out_of_flight == 3 + 3 + 1


def test_the_progress_file_round_trips_under_the_keys_its_readers_use(tmp_path):
    path = tmp_path / "status" / "trainer.json"
    write_status(path, {**PROGRESS.as_status(), "steps": [], "cpu_s": 1.0})
    assert TrainerProgress.read(path) == PROGRESS
    # benchmarks/ and the tests read these keys from the file directly.
    assert {"step", "policy_version", "trajectories_trained", "consumed", "duplicates", "dead_lettered",
            "tasks_dead_lettered", "dlq_reasons", "task_dlq_reasons", "too_stale", "finished"} <= set(PROGRESS.as_status())


def test_a_missing_file_or_field_counts_as_nothing(tmp_path):
    assert TrainerProgress.read(tmp_path / "absent.json") == TrainerProgress()
    assert TrainerProgress.from_status({"step": 2, "unrelated": 1}) == TrainerProgress(step=2)
