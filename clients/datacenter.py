"""The datacenter ClientApp: fl-geo's built-in decoder on fl-geo's corpus, one user of the
public client API (fl_geo.clients.api, ``make_client_app``).

A message carries the global model (in the configured downlink precision) and the run's client,
model and data sections. The client loads the model, trains ``inner_steps`` AdamW steps on its
partition, and replies with the pseudo-gradient Δ = θ_global − θ_local in the uplink precision plus
the numbers the server needs (tokens, steps, mean loss, step time). What must survive between
rounds (the AdamW moments and the LR-schedule position, docs/algorithms.md §1) lives in
``context.state``, which Flower keeps per node for the whole run; the wrapper's per-process caches
only hold things that are cheap to rebuild (the model object), and fl_geo.data memoises the
tokenised partitions, because deployment starts a fresh process per message.

This module only says what the built-in model and data are: the model from the run's ``model``
section, training batches from fl-geo's partitions and sampler (with the ``data.noise_*``
options), held-out batches from the partition's or the global held-out text.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Context, Message

from fl_geo.clients import stream
from fl_geo.clients.api import (  # noqa: F401  (re-exported: tests and tools import them from here)
    INNER_STATE_KEYS,
    OPT_STATE_KEY,
    PREV_OPT_STATE_KEY,
    PREV_PROGRESS_KEY,
    PROGRESS_KEY,
    DatacenterClient,
    rewind_to_round,
)
from fl_geo.clients.site import Site
from fl_geo.clients.stream import (  # noqa: F401  (re-exported)
    STREAM_GLOBAL_KEY,
    STREAM_LOCAL_KEY,
    STREAM_META_KEY,
    STREAM_SNAPSHOT_KEY,
    merge_fragment,
)
from fl_geo.data import BatchNoise, BatchSampler, Tokenizer, eval_batches
from fl_geo.inner.model import Decoder
from fl_geo.inner.training import InnerConfig
from fl_geo.runtime.builders import make_model, model_config, partitions, tokenizer


def make_sampler(
    data_cfg: dict[str, Any], tokens: torch.Tensor, icfg: InnerConfig, pid: int, vocab_size: int, data_seed: int
) -> BatchSampler:
    """This partition's training sampler; partitions in ``data.noise_partitions`` get a fraction of
    low-quality batches (``data.noise_*``, EDiT-style loss spikes). Keys missing from an older
    data section mean no noise."""
    noise = None
    fraction = float(data_cfg.get("noise_fraction", 0.0) or 0.0)
    if fraction > 0 and pid in {int(p) for p in data_cfg.get("noise_partitions") or []}:
        noise = BatchNoise(
            fraction=fraction,
            kind=str(data_cfg.get("noise_kind", "random")),
            block=int(data_cfg.get("noise_block", 1)),
            vocab_size=int(vocab_size),
            shared=bool(data_cfg.get("noise_shared", False)),
        )
    return BatchSampler(tokens, icfg.seq_len, icfg.batch_size, seed=data_seed, stream=pid, noise=noise)


def checked_tokenizer(data_cfg: dict[str, Any]) -> Tokenizer:
    """This node's tokenizer for the run's data section, refused (ValueError: the reply is an
    error naming both identities) when it is not the server's (``tokenizer_sha256`` in the
    section, sent with every job when ``data.tokenizer`` is not ``byte``)."""
    tok = tokenizer(data_cfg)
    expected = data_cfg.get("tokenizer_sha256")
    if expected and expected != tok.sha256:
        raise ValueError(f"tokenizer mismatch: the server's data.tokenizer={data_cfg.get('tokenizer')} has "
                         f"sha256 {str(expected)[:16]}…, this node's {tok.sha256[:16]}…; give every node the same "
                         "tokenizer.json or training text")
    return tok


def decoder(site: Site) -> Decoder:
    """The run's decoder (``model`` section), identical on every node for the run's seed."""
    return make_model(site.sections["model"], site.seed)


def corpus_batches(site: Site) -> BatchSampler:
    """This partition's training batches: fl-geo's sampler over its share of the corpus."""
    data_cfg = dict(site.sections["data"])
    tok = checked_tokenizer(data_cfg)
    parts, _ = partitions(data_cfg, site.num_partitions)
    data_seed = int(data_cfg["seed"]) * 1_000_003 + site.seed
    vocab_size = model_config(site.sections["model"]).vocab_size
    if data_cfg.get("tokenizer", "byte") != "byte":  # noise draws real token ids, not unused model rows
        vocab_size = min(vocab_size, tok.vocab_size)
    return make_sampler(data_cfg, parts[site.partition_id].train, site.inner, site.partition_id, vocab_size, data_seed)


def corpus_eval_batches(site: Site) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Held-out batches: the partition's own (``evaluate``) or the global set (``evaluate.stream``)."""
    checked_tokenizer(dict(site.sections["data"]))
    parts, val_tokens = partitions(site.sections["data"], site.num_partitions)
    tokens = parts[site.partition_id].val if site.eval_scope == "partition" else val_tokens
    return eval_batches(tokens, site.inner.seq_len, site.inner.batch_size, site.eval_batches)


client = DatacenterClient(decoder, corpus_batches, eval_batches_fn=corpus_eval_batches)
app = client.app

# The handlers as plain ``(msg, context) -> reply`` functions, as before the wrapper existed.
query = client.query
train = client.train
evaluate = client.evaluate


def train_stream(msg: Message, context: Context) -> Message:
    return stream.train_stream(client, msg, context)


def evaluate_stream(msg: Message, context: Context) -> Message:
    return stream.evaluate_stream(client, msg, context)
