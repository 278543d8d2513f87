"""The ClientApp: fl-geo's datacenter client around the user's own GRU language model.

fl-geo's wrapper does the rest: the received model is checked against this model's layout, the
inner AdamW state survives rounds, tokens are counted, the device and bf16 autocast follow the
run's ``client`` section, and the reply is the pseudo-gradient in the wire precision.
"""

from fl_geo.clients import Site, make_client_app
from own_model.task import batch_at, heldout_text, make_model, partition_text


def model_fn(site: Site):
    return make_model(site.seed)  # the same initial model on every node and on the server


def batches_fn(site: Site):
    text = partition_text(site.partition_id, site.num_partitions)
    return lambda step: batch_at(text, step, site.inner.batch_size, site.inner.seq_len, seed=site.partition_id)


def eval_batches_fn(site: Site):
    text = heldout_text()
    return [batch_at(text, i, site.inner.batch_size, site.inner.seq_len, seed=99) for i in range(site.eval_batches)]


app = make_client_app(model_fn, batches_fn, eval_batches_fn=eval_batches_fn)
