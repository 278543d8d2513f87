"""Local JSONL / Parquet / Arrow corpora through `datasets`, and the memory-mapped token store."""

from __future__ import annotations

import json
from pydoc_data.topics import topics

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fl_geo.config import load_config
from fl_geo.data import store as store_mod
from fl_geo.data.corpus import Corpus, corpus_digest, load_corpus
from fl_geo.data.partition import PARTITION_SCHEMES, make_tokenizer, partition_corpus
from fl_geo.data.store import build_store, partition_store
from fl_geo.data.tokenizer import ByteTokenizer
from fl_geo.errors import ConfigError

KEYS = sorted(topics)[:24]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    monkeypatch.setenv("FL_GEO_DATA_DIR", str(tmp_path / "cache"))


def _records(keys=KEYS) -> list[dict]:
    return [{"id": i, "body": topics[k]} for i, k in enumerate(keys)] + [{"id": -1, "body": ""}]


def _write(kind: str, directory, records: list[dict], name: str = "part") -> str:
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path = directory / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    elif kind == "parquet":
        path = directory / f"{name}.parquet"
        pq.write_table(pa.Table.from_pylist(records), path, row_group_size=5)
    else:
        path = directory / f"{name}.arrow"
        table = pa.Table.from_pylist(records)
        with pa.ipc.new_stream(str(path), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=5):
                writer.write_batch(batch)
    return str(path)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "arrow"])
def test_readers_give_every_non_empty_text_per_file(kind, tmp_path):
    _write(kind, tmp_path / "d", _records(KEYS[:12]), "first")
    _write(kind, tmp_path / "d", _records(KEYS[12:]), "second")
    corpus = load_corpus(kind, path=str(tmp_path / "d"), text_field="body")
    docs = list(corpus.iter_documents())
    assert [d.text for d in docs] == [topics[k] for k in KEYS]  # empty texts skipped, file order kept
    assert corpus.groups == ["first", "second"] and [d.group for d in docs] == ["first"] * 12 + ["second"] * 12
    same = load_corpus(kind, path=str(tmp_path / "d" / "*"), text_field="body")
    assert same.sha256 == corpus.sha256
    assert load_corpus(kind, path=str(tmp_path / "d"), text_field="id").sha256 != corpus.sha256


def test_missing_text_field_and_path_are_one_line_errors(tmp_path):
    path = _write("jsonl", tmp_path, _records(KEYS[:3]))
    corpus = load_corpus("jsonl", path=path, text_field="text")
    with pytest.raises(ConfigError, match=r"no string field data.text_field='text' \(it has: id, body\)") as err:
        list(corpus.iter_documents())
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="data.path") as err:
        load_corpus("parquet", path=str(tmp_path / "none*.parquet"))
    with pytest.raises(ConfigError, match="data.corpus=arrow needs data.path"):
        load_config(None, ["data.corpus=arrow"])


def _in_memory(kind_path: tuple[str, str]) -> Corpus:
    corpus = load_corpus(kind_path[0], path=kind_path[1], text_field="body")
    docs = list(corpus.iter_documents())
    return Corpus(name="mem", documents=docs, sha256=corpus_digest(docs))


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_store_partitions_equal_the_in_memory_ones(tokenizer, tmp_path, monkeypatch):
    path = _write("parquet", tmp_path / "d", _records())
    _write("parquet", tmp_path / "d", _records(sorted(topics)[24:30]), "extra")
    lazy = load_corpus("parquet", path=str(tmp_path / "d"), text_field="body")
    mem = _in_memory(("parquet", str(tmp_path / "d")))
    tok = ByteTokenizer() if tokenizer == "byte" else make_tokenizer("bpe", lazy, 0.1, 300, tmp_path / "tok")
    if tokenizer == "bpe":  # the lazy (streamed) corpus trains the very tokenizer the in-memory one does
        assert make_tokenizer("bpe", mem, 0.1, 300, tmp_path / "tok2").sha256 == tok.sha256
    monkeypatch.setattr(store_mod, "ENCODE_BATCH", 4)  # the corpus is written to disk in chunks of 4 documents
    store = build_store(lazy, tok, 0.1, tmp_path / "stores")
    assert isinstance(store.train, np.memmap) and store.train.dtype == (np.uint8 if tokenizer == "byte" else np.uint16)
    assert len(store.train_lens) == 30 and store.groups == ["extra", "part"]
    for scheme in PARTITION_SCHEMES:
        ours, val = partition_store(store, "parquet", 3, scheme, seed=1)
        ref, ref_val = partition_corpus(mem, 3, scheme, 0.1, seed=1, tokenizer=tok)
        assert torch.equal(val.long(), ref_val.long())
        for a, b in zip(ours, ref, strict=True):
            assert a.groups == b.groups
            assert torch.equal(a.train.long(), b.train.long()) and torch.equal(a.val.long(), b.val.long())
    assert path  # the store is reused: same directory, no rewrite
    again = build_store(lazy, tok, 0.1, tmp_path / "stores")
    assert again.directory == store.directory and len(list((tmp_path / "stores").glob("tokens-*"))) == 1


def test_run_config_reads_a_dataset_with_bpe_and_noise(tmp_path):
    from fl_geo.runtime.builders import partitions, tokenizer

    path = _write("jsonl", tmp_path / "d", _records())
    cfg = load_config(None, ["data.corpus=jsonl", f"data.path={path}", "data.text_field=body", "data.tokenizer=bpe",
                             "data.bpe_vocab_size=20000", "data.partition=iid"])
    parts, val = partitions(cfg.data, 2)
    tok = tokenizer(cfg.data)
    assert tok.vocab_size < cfg.model.vocab_size  # a small corpus stops short of 20000 merges
    assert int(val.long().max()) < tok.vocab_size and int((val.long() == tok.eos_id).sum()) == len(KEYS)
    from clients.datacenter import make_sampler
    from fl_geo.runtime.builders import inner_config

    inner = inner_config({"lr": 1e-3, "min_lr_ratio": 0.1, "warmup_steps": 0, "total_steps": 10, "beta1": 0.9,
                          "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0, "batch_size": 8,
                          "seq_len": 32, "precision": "fp32", "device": "cpu"}, 10)
    data = {"noise_partitions": [0], "noise_fraction": 1.0, "noise_kind": "random"}
    sampler = make_sampler(data, parts[0].train, inner, 0, tok.vocab_size, 0)
    x, _ = sampler.batch(3)
    assert int(x.max()) < tok.vocab_size and int(x.min()) >= 0
    clean = make_sampler({}, parts[0].train, inner, 0, tok.vocab_size, 0).batch(3)[0]
    assert int(clean.max()) < tok.vocab_size  # real windows from the memory map


def test_missing_datasets_extra_is_one_line(tmp_path, monkeypatch):
    import sys

    path = _write("jsonl", tmp_path, _records(KEYS[:2]))
    corpus = load_corpus("jsonl", path=path, text_field="body")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"needs the `datasets` package: pip install 'fl-geo\[data\]'"):
        list(corpus.iter_documents())
