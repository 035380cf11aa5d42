"""The supervisor's restart rule: a backoff that doubles up to its cap, and a crash loop left stopped."""

from __future__ import annotations

from iop_cli.supervisor import BACKOFF_CAP, BACKOFF_FIRST, CRASH_LOOP, CRASH_WINDOW, Watched, _exited


def test_each_exit_doubles_the_wait_up_to_the_cap() -> None:
    seen, waits = Watched(), []
    for exit_number in range(CRASH_LOOP - 1):
        now = exit_number * 1.0
        _exited("node", seen, -9, now)
        assert seen.state == "restarting" and seen.restart_at is not None
        waits.append(seen.restart_at - now)
        seen.state = "running"
    assert waits[:3] == [BACKOFF_FIRST, 2 * BACKOFF_FIRST, 4 * BACKOFF_FIRST]
    assert max(waits) == BACKOFF_CAP
    assert seen.last_exit == "signal 9 (SIGKILL)"


def test_a_crash_loop_is_given_up_and_old_exits_are_forgotten() -> None:
    seen = Watched()
    for exit_number in range(CRASH_LOOP - 1):
        _exited("edge", seen, 1, exit_number * 1.0)
        seen.state = "running"
    later = CRASH_WINDOW + CRASH_LOOP  # the earlier exits are out of the window: a fresh start
    _exited("edge", seen, 1, later)
    assert seen.state == "restarting" and seen.restart_at == later + BACKOFF_FIRST
    seen.state = "running"
    for exit_number in range(1, CRASH_LOOP):
        _exited("edge", seen, 3, later + exit_number)
        if seen.state == "given up":
            break
        seen.state = "running"
    assert seen.state == "given up" and len(seen.exits) == CRASH_LOOP and seen.last_exit == "code 3"
