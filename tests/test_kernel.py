"""The outer-loop kernel (`OuterLoop.run`) and the first-claims rule every asynchronous loop shares.

The loops themselves are tested end to end elsewhere (test_sync, test_async, test_streaming_loop,
test_halos_loop, test_sharded_*); here the contract they rely on: the order of the hooks, that
`close` runs after an error, that a `NoLiveNode` stops the loop cleanly, and the claim cap.
"""

from __future__ import annotations

import pytest

from fl_geo.core.claims import ClaimBound
from fl_geo.strategies.base import OuterLoop
from fl_geo.strategies.kernel import NoLiveNode


class _Recorder(OuterLoop):
    """A loop whose hooks only record that they ran (no model, grid or config behind it)."""

    def __init__(self, moves: int, fail_at: int | None = None, no_node_at: int | None = None,
                 stop_at: int | None = None) -> None:  # skips OuterLoop.__init__ on purpose
        self.calls: list[str] = []
        self.history = []
        self.moves, self.fail_at, self.no_node_at, self.stop_at = moves, fail_at, no_node_at, stop_at
        self.done_moves = 0
        self.stop_reason = None

    def log_initial(self) -> None:
        self.calls.append("log_initial")
        self.history.append({"step": 0})

    def open(self) -> None:
        self.calls.append("open")

    def begin(self) -> None:
        self.calls.append("begin")

    def done(self) -> bool:
        return self.done_moves >= self.moves

    def advance(self) -> bool:
        self.done_moves += 1
        self.calls.append(f"advance {self.done_moves}")
        if self.done_moves == self.fail_at:
            raise RuntimeError("boom")
        if self.done_moves == self.no_node_at:
            raise NoLiveNode("no live node to train on")
        if self.done_moves == self.stop_at:
            self.stop_reason = "stopped by the policy"
            return False
        self.history.append({"step": self.done_moves})
        return True

    def finish(self) -> None:
        self.calls.append("finish")

    def close(self) -> None:
        self.calls.append("close")

    def stop(self, reason: str, quiet: bool = False) -> None:
        self.stop_reason = reason


def test_the_kernel_runs_the_hooks_in_order_and_returns_the_last_record():
    loop = _Recorder(moves=3)
    assert loop.run() == {"step": 3}
    assert loop.calls == ["open", "log_initial", "begin", "advance 1", "advance 2", "advance 3", "finish", "close"]
    assert loop.stop_reason is None


def test_a_policy_that_stops_early_still_finishes_and_closes():
    loop = _Recorder(moves=5, stop_at=2)
    assert loop.run() == {"step": 1}
    assert loop.calls[-3:] == ["advance 2", "finish", "close"] and loop.stop_reason == "stopped by the policy"


def test_no_live_node_stops_the_loop_with_its_reason():
    loop = _Recorder(moves=5, no_node_at=3)
    assert loop.run() == {"step": 2}
    assert loop.stop_reason == "no live node to train on"
    assert loop.calls[-2:] == ["finish", "close"]


def test_close_runs_after_an_error_and_the_error_propagates():
    loop = _Recorder(moves=5, fail_at=2)
    with pytest.raises(RuntimeError, match="boom"):
        loop.run()
    assert loop.calls[-2:] == ["advance 2", "close"]  # no finish: the run did not end normally


def test_a_loop_already_done_only_logs_and_finishes():
    """A synchronous run resumed from its final checkpoint: nothing to advance."""
    loop = _Recorder(moves=0)
    assert loop.run() == {"step": 0}
    assert loop.calls == ["open", "log_initial", "begin", "finish", "close"]


@pytest.mark.parametrize(("claims", "cap"), [([160], 160), ([160, 2**40], 160), ([2**40, 160], 160),
                                             ([100, 160, 2**40], None), ([], None)])
def test_too_few_first_claims_count_for_their_lower_median_at_most(claims, cap):
    assert ClaimBound().cap_few(claims) == cap


def test_with_accepted_history_no_cap_applies():
    bound = ClaimBound()
    bound.accepted(0, 160)
    assert bound.cap_few([160, 2**40]) is None  # the history judges them instead
    assert bound.judge(2**40) is not None and bound.judge(160) is None
