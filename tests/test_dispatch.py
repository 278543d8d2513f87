"""The dispatcher against a grid whose replies become ready in an order the test chooses."""

from __future__ import annotations

import itertools

import pytest
from flwr.app import ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from fl_geo.runtime.dispatch import Dispatcher, JobTiming
from fl_geo.scenario_files import scenario_from_dict
from fl_geo.timing.clock import VirtualClock, WallClock


class ScriptedGrid:
    """Replies exist only once the test releases them: real completion order is the test's."""

    def __init__(self, nodes):
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
        self.nodes = set(nodes)
        self.pushed: dict[str, Message] = {}
        self.ready: dict[str, Message] = {}
        self._ids = itertools.count()

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, msgs):
        out = []
        for m in msgs:
            if m.metadata.dst_node_id not in self.nodes:
                out.append("")
                continue
            mid = f"m{next(self._ids)}"
            m.metadata.__dict__["_message_id"] = mid
            self.pushed[mid] = m
            out.append(mid)
        return out

    def pull_messages(self, ids):
        return [self.ready.pop(i) for i in list(ids) if i in self.ready]

    def release(self, node, error=False):
        mid = next(i for i, m in self.pushed.items() if m.metadata.dst_node_id == node)
        msg = self.pushed.pop(mid)
        content = Error(code=300, reason="boom") if error else RecordDict({"c": ConfigRecord({"node": node})})
        self.ready[mid] = Message(content, reply_to=msg)


def _msg(node):
    return Message(RecordDict({"c": ConfigRecord({"x": 1})}), dst_node_id=node, message_type=MessageType.TRAIN)


SCENARIO = {
    "name": "t", "server_region": "a", "regions": ["a"],
    "nodes": [{"region": "a", "speed": s} for s in (1.0, 1.0, 2.0, 0.5)],
    "links": {"bandwidth_gbps": [[8.0]]},
    "model": {"num_params": 1000, "step_time_s": 1.0},
}


def _virtual_dispatcher(nodes):
    grid = ScriptedGrid(nodes)
    return grid, Dispatcher(grid, VirtualClock(scenario_from_dict(SCENARIO)), poll_interval_s=0.0)


def test_at_most_one_message_in_flight_per_node():
    grid = ScriptedGrid([1, 2])
    d = Dispatcher(grid, WallClock(), poll_interval_s=0.0)
    d.submit([_msg(1)])
    with pytest.raises(ValueError, match="still have a job in flight"):
        d.submit([_msg(1)])
    with pytest.raises(ValueError, match="at most one message per node"):
        d.submit([_msg(2), _msg(2)])
    grid.release(1)
    ev = d.next_event()
    assert ev.ok and ev.job.node == 1
    d.submit([_msg(1)])  # free again once its event was handed over


@pytest.mark.parametrize("real_order", list(itertools.permutations([10, 11, 12, 13])))
def test_virtual_order_is_independent_of_real_completion_order(real_order):
    nodes = [10, 11, 12, 13]
    grid, d = _virtual_dispatcher(nodes)
    # steps 3, 1, 4, 1 at speeds 1, 1, 2, 0.5 -> compute 3, 1, 2, 2 s (+ 2 x 1000 B at 8 Gbit/s)
    d.submit([_msg(n) for n in nodes], [JobTiming(i, s, 1000, 1000) for i, s in enumerate((3, 1, 4, 1))])
    for n in real_order:
        grid.release(n)
    events = [d.next_event() for _ in nodes]
    assert [e.job.node for e in events] == [11, 12, 13, 10]  # by finish time, ties by scenario index
    assert [round(e.time, 6) for e in events] == [1.000002, 2.000002, 2.000002, 3.000002]
    assert d.next_event() is None  # nothing in flight


def test_deadline_closes_the_window_before_the_next_finish():
    grid, d = _virtual_dispatcher([10, 11])
    d.submit([_msg(10), _msg(11)], [JobTiming(0, 1), JobTiming(1, 5)])
    grid.release(10)
    grid.release(11)
    first = d.next_event(deadline=10.0)
    assert first.job.node == 10 and first.time == 1.0
    assert d.next_event(deadline=first.time + 0.5) is None  # node 11 finishes at 5 s
    assert d.clock.now() == 1.5
    assert d.next_event(deadline=9.0).job.node == 11


def test_error_vanished_and_unknown_nodes_are_events_once():
    grid = ScriptedGrid([1, 2, 3])
    d = Dispatcher(grid, WallClock(), poll_interval_s=0.0, liveness_every_s=0.0)
    jobs = d.submit([_msg(1), _msg(2), _msg(3), _msg(99)])
    assert jobs[3].node == 99
    grid.release(1, error=True)
    grid.nodes.discard(2)  # node 2 dies with its job in flight
    seen = {}
    for _ in range(3):
        ev = d.next_event(block=False) or d.next_event(block=False)
        seen[ev.job.node] = ev.error
    assert seen[99] == "vanished" and seen[2] == "vanished" and seen[1].startswith("300")
    assert d.busy_nodes() == {3}
    grid.release(3)
    assert d.next_event().ok
    assert d.next_event() is None


def test_abandoned_job_keeps_its_node_busy_until_the_late_reply():
    grid = ScriptedGrid([1])
    d = Dispatcher(grid, WallClock(), poll_interval_s=0.0)
    (job,) = d.submit([_msg(1)])
    d.abandon(job)
    assert d.busy_nodes() == {1} and not d.in_flight()
    grid.release(1)
    assert d.next_event(block=False) is None  # the late reply is discarded, not handed over
    assert d.late_replies == 1 and d.busy_nodes() == set()


def test_run_jobs_hands_over_in_rank_order_in_groups():
    grid = ScriptedGrid([5, 6, 7])
    d = Dispatcher(grid, WallClock(), poll_interval_s=0.0)
    groups = []
    msgs = [_msg(n) for n in (5, 6, 7)]
    # release everything before the round starts pulling: one group, in the given order
    orig_push = grid.push_messages

    def push_and_release(ms):
        out = orig_push(ms)
        for n in (7, 5, 6):
            grid.release(n)
        return out

    grid.push_messages = push_and_release
    outcome = d.run_jobs(msgs, on_replies=lambda g: groups.append([n for n, _ in g]), order=[6, 5, 7])
    assert groups == [[6, 5, 7]] and outcome.replied == [6, 5, 7]


def test_the_poll_interval_follows_the_transport():
    """A deployment grid's pulls are RPCs to the SuperLink: the dispatcher waits up to 250 ms
    between empty pulls there (measured: 20 ms doubled the SuperLink's CPU in a two-site run),
    20 ms on an in-process grid; an explicit interval wins."""
    from flwr.superlink.grid.http_grid import HttpGrid

    from fl_geo.runtime.dispatch import POLL_IN_PROCESS_S, POLL_OVER_NETWORK_S

    assert Dispatcher(ScriptedGrid([1]), WallClock()).poll_interval_s == POLL_IN_PROCESS_S == 0.02
    remote = HttpGrid("127.0.0.1:1", insecure=True, token="t")  # not connected until first used
    assert Dispatcher(remote, WallClock()).poll_interval_s == POLL_OVER_NETWORK_S == 0.25
    assert Dispatcher(remote, WallClock(), poll_interval_s=0.5).poll_interval_s == 0.5
