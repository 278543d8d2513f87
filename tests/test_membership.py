"""Node identity: a profile is a claim the server checks before any job depends on it
(fl_geo.runtime.membership). Unit tests of the rules, then the real loop on the InlineGrid with a
node that lies in its answer to the profile query."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ConfigRecord, Message

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.membership import (
    MAX_PARTITIONS,
    Membership,
    NodeProfile,
    ProfileError,
    profile_from_record,
)
from fl_geo.runtime.protocol import PROFILE_KEY
from fl_geo.server_app import run_server
from tests.conftest import keep_declaration

# ---- the rules --------------------------------------------------------------------------------


def test_a_well_formed_profile_is_read_field_by_field():
    p = profile_from_record(7, {"partition_id": 2, "num_partitions": 3, "device": "cuda:1", "site": "eu", "devices": 8})
    assert (p.node_id, p.partition_id, p.num_partitions, p.device, p.site, p.devices) == (7, 2, 3, "cuda:1", "eu", 8)
    assert profile_from_record(7, {"partition_id": 0, "num_partitions": 1}).devices is None


@pytest.mark.parametrize("record, field", [
    ({"num_partitions": 3}, "partition_id"),
    ({"partition_id": 0}, "num_partitions"),
    ({"partition_id": 3, "num_partitions": 3}, "partition_id"),
    ({"partition_id": -1, "num_partitions": 3}, "partition_id"),
    ({"partition_id": 1.5, "num_partitions": 3}, "partition_id"),
    ({"partition_id": "0", "num_partitions": 3}, "partition_id"),
    ({"partition_id": True, "num_partitions": 3}, "partition_id"),
    ({"partition_id": 0, "num_partitions": float("nan")}, "num_partitions"),
    ({"partition_id": 0, "num_partitions": MAX_PARTITIONS + 1}, "num_partitions"),
    ({"partition_id": 0, "num_partitions": 0}, "num_partitions"),
    ({"partition_id": 0, "num_partitions": 3, "devices": 0}, "devices"),
    ({"partition_id": 0, "num_partitions": 3, "devices": 10**9}, "devices"),
    ({"partition_id": 0, "num_partitions": 3, "site": "x" * 1000}, "site"),
    ({"partition_id": 0, "num_partitions": 3, "device": 5}, "device"),
])
def test_a_malformed_profile_names_its_field(record, field):
    with pytest.raises(ProfileError, match=f"'{field}'"):
        profile_from_record(1, record)


def _prof(node, pid, parts=3):
    return NodeProfile(node_id=node, partition_id=pid, num_partitions=parts)


def test_one_live_node_per_partition_lowest_node_id_wins_ties(caplog):
    m = Membership()
    caplog.set_level("WARNING", logger="fl_geo")
    got = m.admit({20: _prof(20, 0), 10: _prof(10, 0), 30: _prof(30, 1)}, {}, live=[10, 20, 30])
    assert sorted(got) == [10, 30]
    assert "refused node 20: claims partition-id 0, held by live node 10" in caplog.text
    assert m.waiting(20) and 20 not in m.refused  # asked again later, not refused for good
    # a newcomer claiming a partition held by a live node is refused ...
    admitted = {10: _prof(10, 0), 30: _prof(30, 1)}
    assert m.admit({40: _prof(40, 1)}, admitted, live=[10, 30, 40]) == {}
    # ... and admitted once the holder is gone (a SuperNode restarted with a new node id)
    assert list(m.admit({40: _prof(40, 1)}, admitted, live=[10, 40])) == [40]


def test_the_partition_count_is_fixed_by_the_majority_and_slots_bound_the_ids():
    m = Membership(slots=3)
    got = m.admit({1: _prof(1, 0), 2: _prof(2, 1), 3: _prof(3, 2, parts=1000)}, {}, live=[1, 2, 3])
    assert sorted(got) == [1, 2] and m.num_partitions == 3 and "num-partitions=1000" in m.refused[3]
    m = Membership(slots=2)
    assert m.admit({1: _prof(1, 2)}, {}, live=[1]) == {} and "2 node slots" in m.refused[1]


# ---- the loop, with a node that lies about itself ------------------------------------------------


def _run(cfg, tmp_path, lie):
    """Run ``cfg`` with the highest-partition node's profile answer replaced by ``lie``."""

    def hook(node, msg, reply):
        if msg.metadata.message_type != "query" or reply.has_error():
            return reply
        profile = dict(reply.content.config_records[PROFILE_KEY])
        if profile["partition_id"] != cfg.run.num_clients - 1:
            return reply
        return Message(keep_declaration(reply, {PROFILE_KEY: ConfigRecord({**profile, **lie})}), reply_to=msg)

    grid = InlineGrid(client_app, cfg.run.num_clients, seed=cfg.run.seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / "run")
    return summary, torch.load(tmp_path / "run" / "final_model.pt")["params"], grid


LIES = {
    "someone else's partition": ({"partition_id": 0}, "claims partition-id 0, held by live node"),
    "a huge partition count": ({"num_partitions": 10**9}, "'num_partitions'=1000000000 must be a whole number"),
    "another partition count": ({"num_partitions": 4}, "claims num-partitions=4, the run's nodes have 3"),
    "a partition id that is not a number": ({"partition_id": "0; drop"}, "'partition_id'='0; drop' must be a whole"),
}


@pytest.mark.parametrize("case", sorted(LIES))
def test_a_node_lying_about_its_partition_is_refused_and_the_run_trains_on_the_others(tiny, tmp_path, case, caplog):
    lie, reason = LIES[case]
    caplog.set_level("WARNING", logger="fl_geo")
    cfg = tiny("run.rounds=2")
    summary, _, grid = _run(cfg, tmp_path, lie)
    assert reason in caplog.text, caplog.text[-2000:]
    # two honest nodes, each round: their tokens only (the liar got no job and counts nothing)
    per_job = cfg.strategy.inner_steps * cfg.client.batch_size * cfg.client.seq_len
    assert summary["outer_steps"] == 2 and summary["tokens"] == 2 * 2 * per_job
    trained = [n for n, ctx in grid.contexts.items() if "inner_progress" in ctx.state.config_records]
    assert len(trained) == 2
