"""The gateway's receive window as plain calls (netstorm/lan/window.py): which iterations' tokens go in, and
the horizon past which DATA is refused, across completion, failure and the 2**32 wrap."""

from __future__ import annotations

from netstorm.lan.window import ReceiveWindow, newer


def test_before_the_window_is_known_any_iteration_may_come() -> None:
    window = ReceiveWindow(8)
    assert window.horizon is None and not window.beyond(10**6) and not window.inside(0)


def test_the_horizon_is_the_window_start_until_an_iteration_completes() -> None:
    window = ReceiveWindow(8)
    assert list(window.expect(5) or ()) == list(range(5, 13))
    assert window.horizon == 5
    assert window.beyond(6) and window.beyond(7) and not window.beyond(5) and not window.beyond(4)
    assert window.inside(12) and not window.inside(13)
    assert window.complete(5)
    assert window.horizon == 6 and window.beyond(7) and not window.beyond(6)
    assert not window.complete(4) and window.horizon == 6   # an older completion never lowers it
    assert list(window.expect(6) or ()) == [13]             # only the newly covered iteration's tokens
    assert window.expect(6) is None and window.horizon == 6


def test_a_failed_or_completed_iteration_far_behind_the_window_leaves_the_horizon_at_its_start() -> None:
    window = ReceiveWindow(8)
    window.expect(40)
    window.complete(30)
    assert window.horizon == 40


def test_iterations_compare_modulo_two_to_the_32() -> None:
    top = 2**32 - 1
    assert newer(0, top) and not newer(top, 0)
    window = ReceiveWindow(8)
    window.expect(top)
    window.complete(top)
    assert window.horizon == 2**32   # the next one, which the wire carries as 0
    assert not window.beyond(0) and window.beyond(1)
