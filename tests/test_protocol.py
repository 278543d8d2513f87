"""fl-geo's typed message protocol: round trips, and every way a request or reply can be wrong is
refused with a message that names the field or the versions; end to end, a reply of another
protocol version is rejected and counted while the model stays intact."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ConfigRecord, Message, MessageType, RecordDict

from fl_geo.clients.datacenter import app as client_app
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.protocol import (
    PROTOCOL_KEY,
    PROTOCOL_VERSION,
    REQUEST_RECORD,
    BridgeRequest,
    EvaluateRequest,
    ProfileQuery,
    ProtocolError,
    ReplyDeclaration,
    StreamRequest,
    TrainRequest,
    declaration_of,
)
from fl_geo.server_app import run_server
from fl_geo.strategies.base import client_config_record
from fl_geo.strategies.replies import ReplyError, read_reply


@pytest.fixture
def job(tiny) -> dict:
    return dict(client_config_record(tiny()), round=3, base_version=2)


def _stream(job: dict) -> StreamRequest:
    return StreamRequest(**job, stream_rule="cocodc", fragments=2, alpha=0.5, lambda_=0.5, tau=1, H=4,
                         stream_step=0, stream_steps=2,
                         stream_apply="[]", stream_sync="[0]")


def test_every_request_round_trips(job):
    requests = [
        TrainRequest(**job), TrainRequest(**job, send="params", start_step=40, time_budget_s=2.5, checkpoint_step=4,
                                          ps_job="v1-p0-3", ps_addresses=json.dumps(["127.0.0.1:1"])),
        _stream(job), EvaluateRequest(**job), EvaluateRequest(**job, eval_batches=4), ProfileQuery(ask="profile"),
        BridgeRequest(stop=False, global_version=7, exchange_timeout_s=600.0, connect_timeout_s=60.0),
        ReplyDeclaration(payload="pseudo_grad", precision="bf16"),
    ]
    for request in requests:
        record = request.to_record()
        assert record[PROTOCOL_KEY] == PROTOCOL_VERSION
        assert type(request).from_record(record) == request
    assert "lambda" in _stream(job).to_record() and "lambda_" not in _stream(job).to_record()
    assert "start_step" not in TrainRequest(**job).to_record()  # unset optional fields are omitted


def test_a_misspelled_or_missing_field_fails_on_the_server_before_sending(job):
    with pytest.raises(TypeError, match="inner_stpes"):
        TrainRequest(**job, inner_stpes=3)
    missing = dict(job)
    del missing["seed"]
    with pytest.raises(TypeError, match="seed"):
        TrainRequest(**missing)
    with pytest.raises(ProtocolError, match="wire_up must be one of"):
        TrainRequest(**{**job, "wire_up": "fp8"})
    with pytest.raises(ProtocolError, match="send must be pseudo_grad, params or grad"):
        TrainRequest(**job, send="gradients")
    # a gradient job (ddp) is one batch: inner_steps 1 and the batch's position
    assert TrainRequest(**{**job, "inner_steps": 1}, send="grad", start_step=4).start_step == 4
    with pytest.raises(ProtocolError, match="send=grad is one step's gradient"):
        TrainRequest(**{**job, "inner_steps": 1}, send="grad")
    with pytest.raises(ProtocolError, match="send=grad is one step's gradient"):
        TrainRequest(**{**job, "inner_steps": 3}, send="grad", start_step=0)


@pytest.mark.parametrize("change, match", [
    ({"inner_stpes": 3}, r"unknown field\(s\) \['inner_stpes'\]; valid: .*inner_steps"),
    ({"seed": None}, r"missing field\(s\) \['seed'\]"),
    ({"inner_steps": "3"}, r"TrainRequest.inner_steps must be int, got str"),
    ({"inner_steps": 2.5}, r"TrainRequest.inner_steps must be int, got float"),
    ({"checkpoint_step": True}, r"TrainRequest.checkpoint_step must be int \| None, got bool"),
    ({"checkpoint_step": -2}, r"checkpoint_step must be >= 0"),
    ({"keep_prev": True}, r"unknown field\(s\) \['keep_prev'\]"),  # protocol 2's field
    ({"inner_steps": -1}, r"inner_steps must be >= 0"),
    ({"client": "{not json"}, r"TrainRequest.client is not valid JSON"),
    ({PROTOCOL_KEY: PROTOCOL_VERSION + 1},
     rf"protocol version {PROTOCOL_VERSION + 1} from the server, this client speaks {PROTOCOL_VERSION}"),
    ({PROTOCOL_KEY: None}, r"protocol version None"),
])
def test_a_client_refuses_a_malformed_request_naming_the_field(job, change, match):
    values = {**TrainRequest(**job).to_record()}
    for key, value in change.items():
        if value is None:
            values.pop(key)
        else:
            values[key] = value
    with pytest.raises(ProtocolError, match=match):
        TrainRequest.from_record(ConfigRecord(values))


def test_the_client_app_answers_a_bad_request_with_an_error_and_changes_nothing(tiny, job):
    """What a SuperNode sends back for a request of another version: an error reply (the
    ClientApp's exception), and its context.state is untouched."""
    grid = InlineGrid(client_app, 1)
    node = next(iter(grid.get_node_ids()))
    record = TrainRequest(**job).to_record()
    record[PROTOCOL_KEY] = PROTOCOL_VERSION + 1
    ids = grid.push_messages([Message(RecordDict({REQUEST_RECORD: record}), dst_node_id=node,
                                      message_type=MessageType.TRAIN)])
    (reply,) = grid.pull_messages(ids)
    expected = f"protocol version {PROTOCOL_VERSION + 1} from the server, this client speaks {PROTOCOL_VERSION}"
    assert reply.has_error() and expected in reply.error.reason
    assert len(grid.contexts[node].state) == 0
    ids = grid.push_messages([Message(RecordDict({"config": ConfigRecord({"inner_steps": 3})}), dst_node_id=node,
                                      message_type=MessageType.TRAIN)])
    (reply,) = grid.pull_messages(ids)
    assert reply.has_error() and "carries no 'fl-geo' record" in reply.error.reason


def _declared_reply(decl: ConfigRecord | None) -> Message:
    content = RecordDict({} if decl is None else {REQUEST_RECORD: decl})
    return Message(content, reply_to=Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN))


def test_reply_declarations_are_read_not_guessed():
    assert declaration_of(_declared_reply(None)) is None
    ok = ReplyDeclaration(payload="params", precision="fp32").to_record()
    assert declaration_of(_declared_reply(ok)) == ReplyDeclaration(payload="params", precision="fp32")
    with pytest.raises(ProtocolError, match=f"reply speaks fl-geo protocol version 9, this server {PROTOCOL_VERSION}"):
        declaration_of(_declared_reply(ConfigRecord({**ok, PROTOCOL_KEY: 9})))
    with pytest.raises(ProtocolError, match="payload 'gradients' is unknown"):
        declaration_of(_declared_reply(ConfigRecord({**ok, "payload": "gradients"})))
    spec_free = _declared_reply(ReplyDeclaration(payload="params", precision="fp32").to_record())
    with pytest.raises(ReplyError, match="declares a 'params' payload, this job asked for pseudo_grad"):
        read_reply(spec_free, None, "fp32")  # type: ignore[arg-type]
    bf16 = _declared_reply(ReplyDeclaration(payload="pseudo_grad", precision="bf16").to_record())
    with pytest.raises(ReplyError, match="declares bf16 arrays, the run's uplink is fp32"):
        read_reply(bf16, None, "fp32")  # type: ignore[arg-type]
    with pytest.raises(ReplyError, match="kept no copy of the model"):
        read_reply(_declared_reply(None), None, "fp32")  # type: ignore[arg-type]


@pytest.mark.parametrize("tamper", ["version", "undeclared-async"])
def test_a_reply_of_another_version_is_rejected_end_to_end(tiny, tmp_path, tamper, caplog):
    """One node's replies claim another protocol version (or, under an asynchronous strategy whose server
    keeps no copy for fl-geo nodes, drop their declaration): rejected and counted, the run ends
    and its model is the one the honest nodes trained."""
    caplog.set_level("WARNING", logger="fl_geo")
    strategy = "diloco" if tamper == "version" else "fedbuff"
    cfg = tiny(f"strategy.name={strategy}", "run.rounds=2")
    grid = InlineGrid(client_app, 3, seed=0)
    liar = min(grid.get_node_ids())

    def hook(node, msg, reply):
        if node != liar or reply.has_error() or msg.metadata.message_type != MessageType.TRAIN:
            return reply
        records = {k: v for k, v in reply.content.items() if k != REQUEST_RECORD}
        if tamper == "version":
            records[REQUEST_RECORD] = ConfigRecord({**reply.content.config_records[REQUEST_RECORD],
                                                    PROTOCOL_KEY: PROTOCOL_VERSION + 1})
        return Message(RecordDict(records), reply_to=msg)

    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / "run")
    assert summary["rejected"] >= 2 and summary["outer_steps"] == 2
    final = torch.load(tmp_path / "run" / "final_model.pt")["params"]
    assert torch.isfinite(final).all()
    expected = f"protocol version {PROTOCOL_VERSION + 1}" if tamper == "version" else "declares no fl-geo protocol"
    assert expected in caplog.text


def test_train_metrics_are_one_type_for_the_client_and_the_server():
    """The client writes its reply metrics through `TrainMetrics`; the server requires exactly its
    fields without a default (no second key list) and reads what the client wrote."""
    from fl_geo.runtime.protocol import TRAIN_METRICS_REQUIRED, TrainMetrics
    from fl_geo.strategies.replies import REPLY_METRICS, read_reply_metrics

    assert REPLY_METRICS == TRAIN_METRICS_REQUIRED == ("tokens", "steps", "train_loss", "step_time_s", "partition_id")
    record = TrainMetrics(tokens=640, steps=5, train_loss=3.5, step_time_s=0.2, partition_id=1, base_version=7,
                          noisy_steps=2).to_record()
    assert record["num-examples"] == 640 and "ps_version" not in record  # unset optional fields are omitted
    m = read_reply_metrics(record, expected_version=7, max_steps=5, step_tokens=128)
    assert (m.tokens, m.steps, m.noisy_steps, m.loss, m.step_time_s) == (640, 5, 2, 3.5, 0.2)
    for key in TRAIN_METRICS_REQUIRED:  # a reply without any one of them is refused, naming it
        partial = TrainMetrics(tokens=640, steps=5, train_loss=3.5, step_time_s=0.2, partition_id=1).to_record()
        del partial[key]
        with pytest.raises(ReplyError, match=key):
            read_reply_metrics(partial)
