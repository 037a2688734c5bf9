"""Finished episodes leave in start order: one that ends early waits for those started before it."""

from sao.sampler.ordering import StartOrder


def test_an_episode_that_ends_early_waits_for_the_ones_started_before_it():
    order, sent = StartOrder(), []
    for key in "abc":
        order.started(key)
    assert order.finished("b", lambda: sent.append("b")) == []  # a is still live
    assert order.held == 1
    for hand_on in order.finished("a", lambda: sent.append("a")):
        hand_on()
    assert sent == ["a", "b"] and order.held == 0  # a, then b, which waited for it
    order.started("d")
    for hand_on in order.finished("c", lambda: sent.append("c")):
        hand_on()
    assert sent == ["a", "b", "c"]


def test_a_stopping_sampler_takes_out_what_waits_and_leaves_the_live_ones():
    order, sent = StartOrder(), []
    for key in "abc":
        order.started(key)
    order.finished("b", lambda: sent.append("b"))
    order.finished("c", lambda: sent.append("c"))
    for hand_on in order.waiting():
        hand_on()
    assert sent == ["b", "c"] and order.held == 0
    for hand_on in order.finished("a", lambda: sent.append("a")):  # a live one ending later still goes out
        hand_on()
    assert sent == ["b", "c", "a"]
