"""A ClientApp that does no training: it exists only to measure server-side overhead.

``fl-geo bench dispatch`` needs a client whose cost is as close to zero as possible, so that what
remains of an update's wall time is Flower's message cost plus the server's own work (dispatcher
and strategy). This client keeps the datacenter client's reply contract, so the real server path
(`Dispatcher`, `AsyncOuterLoop`/`SyncOuterLoop`, reply validation, decoding, folding, the outer
step) runs unchanged on its replies:

- ``query``: the datacenter client's own handler (partition, device, site), which also answers
  the profile probe (a ``train`` message, fl_geo.clients.profile);
- ``train``: replies at once, without decoding the received model, with the update of a worker
  that took no step: a zero pseudo-gradient in the configured ``wire_up`` precision (built once
  per process from the model spec), or, when the server asks for parameters (``send=params``),
  the model it was sent. Its metrics carry the budget the message asked for (``inner_steps``
  steps of ``batch_size x seq_len`` tokens) so token weighting works; ``train_loss`` is 0.0, a
  placeholder that satisfies the contract and means nothing; ``noop=1`` marks the reply.
- no ``evaluate`` handler: a validation loss cannot be produced without evaluating, and a faked
  one would be worse than an error reply. Runs with this client use ``run.client_eval_every=0``.

Never use it for an experiment: its model never changes.
"""

from __future__ import annotations

import json
from functools import lru_cache

import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fl_geo.clients.api import declared, partition_ids, request_of
from fl_geo.clients.datacenter import query
from fl_geo.clients.profile import profile_probe_mod
from fl_geo.core.state import ParamSpec
from fl_geo.runtime.builders import make_model
from fl_geo.runtime.protocol import TrainMetrics, TrainRequest
from fl_geo.runtime.wire import decode_into, encode

app = ClientApp(mods=[profile_probe_mod])  # the profile probe (clients="auto") is answered like a query
app.query()(query)  # the same handler as the datacenter client: one profile contract


@lru_cache(maxsize=4)
def _spec(model_json: str, seed: int) -> ParamSpec:
    """The parameter layout of the run's model (what the server validates replies against)."""
    return ParamSpec.from_state_dict(make_model(model_json, seed).state_dict())


@lru_cache(maxsize=4)
def zero_update(model_json: str, seed: int, precision: str) -> ArrayRecord:
    """A zero pseudo-gradient for the run's model, encoded once per process and precision.

    Sharing one record between replies is safe: the server only reads payloads (decoding is a
    read-only view), and Ray serialises each reply anyway.
    """
    spec = _spec(model_json, seed)
    return encode(torch.zeros(spec.numel, dtype=torch.float32), spec, precision)


def _unchanged_params(msg: Message, req: TrainRequest) -> ArrayRecord:
    """The parameters of a worker that took no step: the model it was sent, in ``wire_up``."""
    received = msg.content.array_records["arrays"]
    up, down = req.wire_up, req.wire_down
    if up == down:
        return received  # already the right bytes: no decode at all
    spec = _spec(req.model, req.seed)
    return encode(decode_into(received, spec, down), spec, up)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Reply immediately with a valid update of a worker that did no work."""
    req: TrainRequest = request_of(msg)
    pid, _ = partition_ids(context)
    client = json.loads(req.client)
    steps = req.inner_steps
    tokens = steps * int(client["batch_size"]) * int(client["seq_len"])
    if req.send == "params":
        arrays = _unchanged_params(msg, req)
    else:
        arrays = zero_update(req.model, req.seed, req.wire_up)
    metrics = TrainMetrics(
        tokens=tokens,
        steps=steps,
        train_loss=0.0,  # placeholder: nothing was trained (see the module docstring)
        step_time_s=0.0,
        train_time_s=0.0,
        partition_id=pid,
        base_version=req.base_version,
        noop=1,
    ).to_record()
    return Message(RecordDict(declared({"arrays": arrays, "metrics": metrics}, req.send, req.wire_up)),
                   reply_to=msg)
