"""The public client API (fl_geo.clients.make_client_app) with a user's model that is not fl-geo's
decoder: a tiny GRU language model on a hand-written, step-indexed batch source.

The ClientApp is driven with the messages fl-geo's server sends (the request built by
``client_config_record``), directly or through the in-process InlineGrid (where an exception
becomes an error reply, as in Flower).
"""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

from fl_geo.clients import DatacenterClient, Site, make_client_app
from fl_geo.clients.api import OPT_STATE_KEY, PROGRESS_KEY
from fl_geo.clients.stream import STREAM_LOCAL_KEY
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.core.streaming import fragment_record
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.protocol import (
    PROTOCOL_KEY,
    PROTOCOL_VERSION,
    REQUEST_RECORD,
    USER_CONFIG_RECORD,
    ProfileQuery,
    TrainRequest,
)
from fl_geo.runtime.wire import PayloadError, decode_into, encode
from fl_geo.strategies.base import client_config_record

VOCAB, WIDTH, SEQ, BATCH = 12, 16, 8, 4


class TinyGRU(nn.Module):
    """A two-block GRU language model: embedding, residual GRU blocks, untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(nn.GRU(WIDTH, WIDTH, batch_first=True) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = h + layer(h)[0]
        return self.head(h)


def gru_model(site: Site) -> nn.Module:
    """Same initial model on every node: seeded by the run's seed, global RNG left alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(site.seed)
        return TinyGRU()


class CountingBatches:
    """Sequences that count up modulo VOCAB from a random start: learnable, per-partition, and a
    pure function of (partition, step)."""

    def __init__(self, partition: int, rows: int = BATCH) -> None:
        self.partition, self.rows = partition, rows

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.partition + step)
        start = torch.randint(0, VOCAB, (self.rows, 1), generator=g)
        seq = (start + torch.arange(SEQ + 1)) % VOCAB
        return seq[:, :-1], seq[:, 1:]


def gru_batches(site: Site) -> CountingBatches:
    return CountingBatches(site.partition_id)


def gru_eval(site: Site) -> list[tuple[torch.Tensor, torch.Tensor]]:
    source = CountingBatches(99 if site.eval_scope == "global" else 50 + site.partition_id)
    return [source.batch(i) for i in range(max(1, site.eval_batches))]


@pytest.fixture(autouse=True)
def _server_identity():
    """Messages are stamped with the sender's task identity; the InlineGrid sets the server's."""
    InlineGrid(make_client_app(gru_model, gru_batches), 0)


def _request(tiny, *overrides: str, **extra) -> ConfigRecord:
    cfg = tiny("client.lr=0.01", "client.warmup_steps=1", "strategy.inner_steps=6", *overrides)
    return ConfigRecord({PROTOCOL_KEY: PROTOCOL_VERSION, **client_config_record(cfg), "round": 1, "base_version": 0,
                         **extra})


def _ctx(partition: int = 0, **node) -> Context:
    return Context(run_id=1, node_id=partition + 1, state=RecordDict(), run_config={},
                   node_config={"partition-id": partition, "num-partitions": 2, **node})


def _initial() -> tuple[torch.Tensor, ParamSpec]:
    model = gru_model(Site(0, 1, seed=0, inner=None))  # type: ignore[arg-type]
    return flatten(model.state_dict()), ParamSpec.from_state_dict(model.state_dict())


def _train_msg(request: ConfigRecord, flat: torch.Tensor, spec: ParamSpec, payload=None,
               node: int = 1) -> Message:
    arrays = payload if payload is not None else encode(flat, spec, str(request["wire_down"]))
    return Message(RecordDict({REQUEST_RECORD: request, "arrays": arrays}), dst_node_id=node,
                   message_type=MessageType.TRAIN)


def _app(**kw) -> DatacenterClient:
    return DatacenterClient(gru_model, gru_batches, eval_batches_fn=gru_eval, **kw)


def _rounds(app: ClientApp, request: ConfigRecord, ctx: Context, rounds: int) -> list[Message]:
    """DiLoCo with outer lr 1 on one worker: the global model becomes the worker's each round."""
    flat, spec = _initial()
    replies = []
    for _ in range(rounds):
        reply = app(_train_msg(request, flat, spec), ctx)
        replies.append(reply)
        delta = decode_into(reply.content.array_records["arrays"], spec, str(request["wire_up"]))
        flat = flat - delta
    return replies


def test_a_user_model_trains_and_its_loss_falls(tiny):
    app = make_client_app(gru_model, gru_batches, eval_batches_fn=gru_eval)
    replies = _rounds(app, _request(tiny), _ctx(), 4)
    losses = [r.content.metric_records["metrics"]["train_loss"] for r in replies]
    assert losses[-1] < 0.7 * losses[0], losses


def test_tokens_are_counted_from_the_batches(tiny):
    request = _request(tiny)
    (reply,) = _rounds(_app().app, request, _ctx(), 1)
    m = reply.content.metric_records["metrics"]
    assert m["steps"] == 6
    assert m["tokens"] == m["num-examples"] == 6 * BATCH * SEQ
    # a user's count (here: targets that are not token 0) is what the reply carries
    def non_zero(x, y):
        return int((y != 0).sum())

    (reply,) = _rounds(_app(tokens_fn=non_zero).app, request, _ctx(), 1)
    expected = sum(non_zero(*CountingBatches(0).batch(s)) for s in range(6))
    assert reply.content.metric_records["metrics"]["tokens"] == expected != 6 * BATCH * SEQ


def test_inner_state_persists_across_rounds_under_the_users_parameter_names(tiny):
    ctx = _ctx()
    client = _app()
    _rounds(client.app, _request(tiny), ctx, 2)
    assert ctx.state.config_records[PROGRESS_KEY]["step"] == 12
    opt = ctx.state.array_records[OPT_STATE_KEY]
    names = [n for n, _ in TinyGRU().named_parameters()]
    assert set(opt) == {f"{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")}
    assert float(opt["head.weight.step"].numpy()) == 12.0
    # the kept state is used: a node that lost it trains differently from the same model
    flat, spec = _initial()
    kept = client.app(_train_msg(_request(tiny), flat, spec), ctx)
    fresh = client.app(_train_msg(_request(tiny), flat, spec), _ctx())
    a = kept.content.array_records["arrays"]["head.weight"].numpy()
    b = fresh.content.array_records["arrays"]["head.weight"].numpy()
    assert not (a == b).all()


def test_a_users_optimizer_and_schedule_keep_their_state(tiny):
    def sgd(model, inner):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    ctx = _ctx()
    replies = _rounds(_app(optimizer_fn=sgd, lr_schedule=None).app, _request(tiny), ctx, 3)
    opt = ctx.state.array_records[OPT_STATE_KEY]
    assert set(opt) == {f"{n}.momentum_buffer" for n, _ in TinyGRU().named_parameters()}
    losses = [r.content.metric_records["metrics"]["train_loss"] for r in replies]
    assert losses[-1] < losses[0]


def test_inner_state_on_disk_resumes_bit_identically(tiny, tmp_path):
    """A restarted server (a new Flower run: empty context.state) that says it resumed gets the
    same reply as a node that never lost its state."""
    request = _request(tiny, f"run.client_state_dir={tmp_path}")
    flat, spec = _initial()
    ctx = _ctx()
    client = _app()
    client.app(_train_msg(request, flat, spec), ctx)
    assert list(tmp_path.rglob("partition-0.pt"))
    resumed = ConfigRecord({**request, "resumed": True})
    b = client.app(_train_msg(resumed, flat, spec), _ctx())  # fresh context, state from disk
    a = client.app(_train_msg(resumed, flat, spec), ctx)  # (b rewrote the file: run it first)
    for key in a.content.array_records["arrays"]:
        assert (a.content.array_records["arrays"][key].numpy()
                == b.content.array_records["arrays"][key].numpy()).all()


def _tampered(kind: str, flat: torch.Tensor, spec: ParamSpec) -> ArrayRecord:
    record = encode(flat, spec, "fp32")
    if kind == "missing":
        del record["head.bias"]
    elif kind == "shape":
        record["head.bias"] = encode(torch.zeros(VOCAB + 1), ParamSpec(("head.bias",), ((VOCAB + 1,),),
                                                                        ("float32",)))["head.bias"]
    elif kind == "nan":
        bad = flat.clone()
        bad[3] = float("nan")
        record = encode(bad, spec, "fp32")
    return record


@pytest.mark.parametrize(("kind", "needle"), [("missing", "head.bias"), ("shape", "shape"),
                                               ("nan", "NaN")])
def test_a_bad_model_payload_is_refused_with_an_error_reply(tiny, kind, needle):
    flat, spec = _initial()
    request = _request(tiny)
    client = _app()
    with pytest.raises(PayloadError, match=needle):
        client.app(_train_msg(request, flat, spec, _tampered(kind, flat, spec)), _ctx())
    grid = InlineGrid(client.app, 1)
    (node,) = grid.get_node_ids()
    msg = _train_msg(request, flat, spec, _tampered(kind, flat, spec), node=node)
    (reply,) = grid.send_and_receive([msg])
    assert reply.has_error() and "PayloadError" in reply.error.reason
    assert OPT_STATE_KEY not in grid.contexts[node].state.array_records  # nothing was trained


def test_evaluate_and_query(tiny):
    flat, spec = _initial()
    request = _request(tiny)
    client = _app()
    msg = Message(RecordDict({REQUEST_RECORD: request, "arrays": encode(flat, spec, "fp32")}), dst_node_id=1,
                  message_type=MessageType.EVALUATE)
    m = client.app(msg, _ctx(1)).content.metric_records["metrics"]
    count = json.loads(str(request["client"]))["eval_batches"]
    assert m["val_tokens"] == count * BATCH * SEQ and m["partition_id"] == 1
    assert 0 < m["val_loss"] < 10
    q = Message(RecordDict({REQUEST_RECORD: ProfileQuery(ask="profile").to_record()}), dst_node_id=1,
                message_type=MessageType.QUERY)
    profile = client.app(q, _ctx(1, site="eu")).content.config_records["profile"]
    assert (profile["partition_id"], profile["site"], profile["device"]) == (1, "eu", "cpu")
    with pytest.raises(RuntimeError, match="eval_batches_fn"):
        DatacenterClient(gru_model, gru_batches).app(msg, _ctx())


def _stream_msg(request: ConfigRecord, content: dict, apply: list[int], sync: list[int]) -> Message:
    cfg = ConfigRecord({**request, "fragments": 2, "stream_rule": "streaming", "H": 4, "alpha": 0.5,
                        "lambda": 0.5, "tau": 1, "stream_step": 0, "stream_steps": 2,
                        "stream_apply": json.dumps(apply),
                        "stream_sync": json.dumps(sync)})
    return Message(RecordDict({REQUEST_RECORD: cfg, **content}), dst_node_id=1,
                   message_type=f"{MessageType.TRAIN}.stream")


@pytest.mark.parametrize("blocks", ["layers", lambda m: [[f"layers.{i}.{n}" for n, _ in b.named_parameters()]
                                                          for i, b in enumerate(m.layers)]])
def test_streaming_fragments_are_cut_from_the_users_blocks(tiny, blocks):
    flat, spec = _initial()
    request = _request(tiny)
    client = _app(blocks=blocks)
    ctx = _ctx()
    first = client.app(_stream_msg(request, {"arrays": encode(flat, spec, "fp32")}, [], [0]), ctx)
    names0 = set(first.content.array_records[fragment_record(0)])
    assert any(n.startswith("embed.") for n in names0) and any(n.startswith("layers.0.") for n in names0)
    assert not any(n.startswith(("layers.1.", "head.")) for n in names0)
    fragments, frag_specs = client.fragments(client.site(TrainRequest.from_record(request), ctx), 2)
    assert set(fragments.names(1)) == {n for n in spec.names if n.startswith(("layers.1.", "head."))}
    # the global fragment 0 comes back: merged into the worker's model, and fragment 1 syncs
    global0 = fragments.gather(flat, 0)
    second = client.app(_stream_msg(request, {fragment_record(0): encode(global0, frag_specs[0], "fp32")},
                                    [0], [1]), ctx)
    m = second.content.metric_records["metrics"]
    assert m["overlap_count"] == 1 and m["steps"] == 2
    assert set(second.content.array_records[fragment_record(1)]) == set(fragments.names(1))
    assert ctx.state.config_records[PROGRESS_KEY]["step"] == 4
    # the worker's own model is scored on the global held-out batches
    ev = Message(RecordDict({REQUEST_RECORD: ConfigRecord({**request, "eval_batches": 2})}),
                 dst_node_id=1, message_type=f"{MessageType.EVALUATE}.stream")
    before = ctx.state.array_records[STREAM_LOCAL_KEY]["flat"].numpy().copy()
    assert client.app(ev, ctx).content.metric_records["metrics"]["val_tokens"] == 2 * BATCH * SEQ
    assert (ctx.state.array_records[STREAM_LOCAL_KEY]["flat"].numpy() == before).all()


def test_bad_blocks_are_a_clear_error(tiny):
    flat, spec = _initial()
    client = _app(blocks=lambda m: [["layers.0.weight_ih_l0"], ["no.such.param"]])
    with pytest.raises(ValueError, match="not a parameter of the model"):
        client.app(_stream_msg(_request(tiny), {"arrays": encode(flat, spec, "fp32")}, [], [0]), _ctx())


def test_bf16_autocast_on_cpu(tiny):
    (reply,) = _rounds(_app().app, _request(tiny, "client.precision=bf16"), _ctx(), 1)
    (fp32,) = _rounds(_app().app, _request(tiny), _ctx(), 1)
    loss = reply.content.metric_records["metrics"]["train_loss"]
    assert torch.isfinite(torch.tensor(loss))
    assert loss != fp32.content.metric_records["metrics"]["train_loss"]  # autocast did run


def test_a_custom_loss_is_used_for_training_and_evaluation(tiny):
    calls = []

    def loss(logits, y):
        calls.append(tuple(logits.shape))
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), label_smoothing=0.1)

    _rounds(_app(loss_fn=loss).app, _request(tiny), _ctx(), 1)
    assert calls and calls[0] == (BATCH, SEQ, VOCAB)


def test_the_data_parallel_job_trains_a_users_model_like_one_process(tiny):
    """Two CPU ranks on halves of the user's batch of 2b rows = one process on the whole batch
    (up to float summation order)."""
    flat, spec = _initial()
    request = _request(tiny, "client.devices=2", "client.dist_backend=gloo")
    client = DatacenterClient(gru_model, two_batches)
    dp = client.app(_train_msg(request, flat, spec), _ctx())
    one = DatacenterClient(gru_model, two_batches).app(_train_msg(_request(tiny), flat, spec), _ctx())
    a = decode_into(dp.content.array_records["arrays"], spec, "fp32")
    b = decode_into(one.content.array_records["arrays"], spec, "fp32")
    assert torch.allclose(a, b, atol=1e-5)
    assert dp.content.metric_records["metrics"]["tokens"] == 6 * 2 * BATCH * SEQ


def two_batches(site: Site) -> CountingBatches:
    """Module level: the data-parallel ranks are spawned and unpickle it."""
    return CountingBatches(site.partition_id, rows=2 * BATCH)


def test_batch_sources_of_every_accepted_shape_give_the_same_batches():
    from fl_geo.clients import as_batch_source

    source = CountingBatches(0)
    want = [source.batch(s) for s in range(5)]
    as_callable = as_batch_source(source.batch)
    as_list = as_batch_source(want)  # re-iterable: replayed from the start, earlier steps skipped
    for s in (3, 4, 0, 1):
        for got in (as_callable.batch(s), as_list.batch(s)):
            assert torch.equal(got[0], want[s][0]) and torch.equal(got[1], want[s][1])
    assert as_batch_source(source) is source
    with pytest.raises(ValueError, match="ran out of batches at step 5"):
        as_list.batch(5)
    with pytest.raises(TypeError, match="one-shot iterator"):
        as_batch_source(iter(want))
    with pytest.raises(TypeError, match="batches_fn must return"):
        as_batch_source(42)


def test_a_model_fn_that_returns_no_module_is_a_clear_error(tiny):
    flat, spec = _initial()
    client = DatacenterClient(lambda site: "not a model", gru_batches)
    with pytest.raises(TypeError, match="model_fn must return a torch.nn.Module"):
        client.app(_train_msg(_request(tiny), flat, spec), _ctx())


def test_blocks_with_a_parameter_twice_are_refused():
    from fl_geo.core.streaming import Fragments

    _, spec = _initial()
    with pytest.raises(ValueError, match="is in blocks 0 and 1"):
        Fragments.from_blocks(spec, 2, [["head.bias"], ["head.bias"]])


def test_the_site_carries_the_node_run_and_user_config(tiny):
    seen = []

    def model_fn(site: Site) -> nn.Module:
        seen.append((site.partition_id, site.num_partitions, site.node_config.get("site"),
                     site.run_config.get("width"), site.inner.batch_size, site.sections["model"]["d_model"]))
        return gru_model(site)

    configs = []

    def batches_fn(site: Site) -> CountingBatches:
        configs.append(dict(site.config))
        return gru_batches(site)

    flat, spec = _initial()
    ctx = Context(run_id=1, node_id=1, state=RecordDict(), run_config={"width": 16},
                  node_config={"partition-id": 1, "num-partitions": 2, "site": "eu"})
    client = DatacenterClient(model_fn, batches_fn)
    client.app(_train_msg(_request(tiny), flat, spec), ctx)
    assert seen == [(1, 2, "eu", 16, 4, 32)] and configs == [{}]
    # the user's own Flower train_config of a message (the "config" record) reaches the callables
    msg = _train_msg(_request(tiny), flat, spec)
    msg.content[USER_CONFIG_RECORD] = ConfigRecord({"dropout": 0.25})
    client.app(msg, ctx)
    assert configs[-1] == {"dropout": 0.25} and len(seen) == 1  # same model: built once
