"""Waiting for a sampler's policy follower to have read what a test announced."""


def wait_until_read(follower, count: int, polls: int = 100) -> None:
    """Poll `follower` until it has read `count` announcements (each poll waits up to 0.2 s); assert it did."""
    for _ in range(polls):
        if follower.messages_read >= count:
            break
        follower.poll(0.2)
    assert follower.messages_read == count
