"""The trajectory log: a resume continues the checkpoint's lineage, each message once; a torn tail is dropped."""

import pytest

from sao.trainer.archive import ArchiveError, TrajectoryArchive, TrajectoryLog, read_records


def test_a_resume_cuts_what_came_after_its_checkpoint_and_logs_each_message_once(tmp_path):
    path = tmp_path / "trajectory-log.bin"
    first = TrajectoryArchive(path)
    first.life(0, 0, False, 1, "[trainer]\n")
    first.trajectory("traj", 0, 0, b"a")
    first.trajectory("traj", 0, 1, b"b")
    first.step(1, 0, [(0, 0), (0, 1)], [(0, 0), (0, 1)], True, 1e-5, [[(0, (0,)), (1, (0, 1))]])
    checkpoint = first.durable_length()
    first.trajectory("traj", 0, 2, b"c")  # read after the checkpoint by a life that then dies
    first.step(2, 1, [(0, 2)], [(0, 2)], True, 1e-5, [[(0, (0,))]])
    first.handle.write(b"\x40\x00\x00\x00torn")  # killed mid-record
    first.handle.flush()

    second = TrajectoryArchive(path, keep_bytes=checkpoint)
    second.life(1, 3, True, 1, "[trainer]\n")
    second.trajectory("traj", 0, 1, b"b")  # buffered at the checkpoint: read again, not logged again
    second.trajectory("traj", 0, 2, b"c")
    second.close()

    kinds = [(r["kind"], r.get("offset", r.get("step"))) for r in read_records(path)]
    assert kinds == [("life", 0), ("trajectory", 0), ("trajectory", 1), ("step", 1), ("life", 1), ("trajectory", 2)]
    assert second.stats.trajectories == 1 and second.stats.bytes == path.stat().st_size
    log = TrajectoryLog.read(path)
    # A pass's rows as msgpack keeps them, which is how replay compares its own: [index, [turns scored in the row]].
    assert [e["passes"] for e in log.events if e["kind"] == "step"] == [[[[0, [0]], [1, [0, 1]]]]]
    assert log.messages == {(0, 0): b"a", (0, 1): b"b", (0, 2): b"c"}


def test_a_torn_last_record_ends_the_log_and_a_foreign_file_is_refused(tmp_path):
    path = tmp_path / "trajectory-log.bin"
    archive = TrajectoryArchive(path)
    archive.life(0, 0, False, 1, "")
    archive.trajectory("traj", 0, 0, None)
    archive.handle.write(b"\xff\x00\x00\x00partial")
    archive.close()
    assert [r["kind"] for r in read_records(path)] == ["life", "trajectory"]
    path.write_bytes(b"not a log")
    with pytest.raises(ArchiveError, match="not a sao trajectory log"):
        TrajectoryLog.read(path)
    with pytest.raises(ArchiveError, match="does not exist"):
        TrajectoryLog.read(tmp_path / "missing.bin")
