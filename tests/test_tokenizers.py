"""Tokenizers (data.tokenizer: byte | bpe | DIR), bits per byte and the BPE end-to-end run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pydoc_data.topics import topics

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fl_geo.config import load_config
from fl_geo.data import ByteTokenizer, eval_batches
from fl_geo.data.corpus import Corpus, Document, corpus_digest
from fl_geo.data.partition import make_tokenizer, partition_corpus, split_text
from fl_geo.errors import ConfigError
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.training import evaluate_loss
from fl_geo.runtime.evaluation import bits_per_byte, target_bytes
from tests.conftest import TINY


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    torch.set_num_threads(1)
    monkeypatch.setenv("FL_GEO_DATA_DIR", str(tmp_path / "cache"))


def _corpus(docs: list[tuple[str, str]]) -> Corpus:
    documents = [Document(name=f"d{i}", group=group, text=text) for i, (group, text) in enumerate(docs)]
    return Corpus(name="test", documents=documents, sha256=corpus_digest(documents))


def _pydoc(count: int = 30) -> Corpus:
    keys = sorted(topics)[:count]
    return _corpus([(f"g{i % 3}", topics[k]) for i, k in enumerate(keys)])


def test_bpe_is_identical_across_trainings_and_processes(tmp_path):
    corpus = _pydoc()
    first = make_tokenizer("bpe", corpus, 0.05, 400, tmp_path / "a")
    second = make_tokenizer("bpe", corpus, 0.05, 400, tmp_path / "b")  # trained again, other cache
    assert first.sha256 == second.sha256 and first.vocab_size == 400
    cached = make_tokenizer("bpe", corpus, 0.05, 400, tmp_path / "a")  # a cache hit
    assert cached.sha256 == first.sha256 and len(list((tmp_path / "a" / "tokenizers").iterdir())) == 1
    code = (
        "import sys; from pydoc_data.topics import topics\n"
        "from fl_geo.data.corpus import Corpus, Document, corpus_digest\n"
        "from fl_geo.data.partition import make_tokenizer\n"
        "keys = sorted(topics)[:30]\n"
        "docs = [Document(name=f'd{i}', group=f'g{i % 3}', text=topics[k]) for i, k in enumerate(keys)]\n"
        "c = Corpus(name='test', documents=docs, sha256=corpus_digest(docs))\n"
        "print(make_tokenizer('bpe', c, 0.05, 400, sys.argv[1]).sha256)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == first.sha256
    assert make_tokenizer("bpe", corpus, 0.05, 512, tmp_path / "a").sha256 != first.sha256  # settings count


def test_bpe_sees_training_text_only(tmp_path):
    # 400 training bytes that repeat "ablative", then a tail (the held-out 20 %) that repeats a word
    # found nowhere else: had the trainer seen the tail, that word would be one merged token.
    train = "the ablative case " * 40
    tail = "zyxwvutsrq " * 16
    text = train + tail
    assert split_text(text, 0.2) == (text[: len(text.encode()) - int(len(text.encode()) * 0.2)],
                                     text[len(text.encode()) - int(len(text.encode()) * 0.2):])
    assert "zyxwvutsrq" not in split_text(text, 0.2)[0]
    tok = make_tokenizer("bpe", _corpus([("g", text)]), 0.2, 300, tmp_path)
    assert len(tok.encode(" ablative")) == 1  # what it was trained on is merged
    assert len(tok.encode(" zyxwvutsrq")) > 3  # the held-out word is not
    # the cache key and the tokenizer ignore the held-out text: another tail of the same length
    other = make_tokenizer("bpe", _corpus([("g", train + "qrstuvwxyz " * 16)]), 0.2, 300, tmp_path / "other")
    assert other.sha256 == tok.sha256


def test_directory_tokenizer_round_trip_and_vocab_resolution(tmp_path):
    tok = make_tokenizer("bpe", _pydoc(), 0.05, 350, tmp_path)
    directory = tmp_path / "tok"
    directory.mkdir()
    tok.tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    loaded = make_tokenizer(str(directory), None, 0.05, 0, None)
    assert loaded.sha256 == tok.sha256 and loaded.eos_id == tok.eos_id == 0
    text = "Ünïcode and code: def f(x):\n    return x ** 2\n"
    ids = loaded.encode(text)
    assert ids.dtype == np.uint16 and loaded.decode(ids) == text
    cfg = load_config(None, ["data.corpus=pydoc", f"data.tokenizer={directory}"])
    assert cfg.model.vocab_size == tok.vocab_size == 350


@pytest.mark.parametrize(("overrides", "needle"), [
    (["data.tokenizer=wordpiece"], "data.tokenizer 'wordpiece' is unknown"),
    (["data.tokenizer=/nonexistent/tok"], "data.tokenizer: directory '/nonexistent/tok' does not exist"),
    (["data.tokenizer=bpe", "data.bpe_vocab_size=200"], "data.bpe_vocab_size must be in [258"),
    (["data.tokenizer=bpe", "model.vocab_size=300"], "model.vocab_size=300 does not match"),
])
def test_config_errors_are_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.corpus=pydoc", *overrides])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bpe_resolves_model_vocab_and_byte_stays_256():
    assert load_config(None, ["data.tokenizer=bpe", "data.bpe_vocab_size=1024"]).model.vocab_size == 1024
    assert load_config(None, []).model.vocab_size == 256


def _hand_bpb(model: torch.nn.Module, batches, bytes_of) -> float:
    """Sum of token NLL (nats) over every target / (ln 2 * bytes those targets decode to)."""
    nll, nbytes = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            logp = F.log_softmax(model(x).double(), dim=-1)
            nll -= float(logp.gather(-1, y[..., None]).sum())
            nbytes += sum(bytes_of(row) for row in y.tolist())
    return nll / (math.log(2) * nbytes)


def test_bits_per_byte_against_a_hand_computation(tmp_path):
    text = "".join(topics[k] for k in sorted(topics)[:12])
    text = text.encode("ascii", "ignore").decode()  # ASCII: every character is one byte
    bpe = make_tokenizer("bpe", _corpus([("g", text)]), 0.05, 300, tmp_path)
    for tok in (ByteTokenizer(), bpe):
        model = build_model(ModelConfig(vocab_size=tok.vocab_size, n_layers=1, d_model=32, n_heads=2, max_seq_len=32), seed=0)
        stream = tok.encode(text[:6000])
        batches = eval_batches(stream, 32, 4, 3)
        loss = evaluate_loss(model, batches)
        ntok = sum(y.numel() for _, y in batches)
        got = bits_per_byte(loss, ntok, target_bytes(batches, tok.token_bytes()))
        hand = _hand_bpb(model, batches, lambda ids, tok=tok: len(tok.decode(ids).encode("utf-8")))
        assert got == pytest.approx(hand, rel=1e-6)
        if isinstance(tok, ByteTokenizer):
            assert got == loss / math.log(2)  # exactly: one token is one byte
        else:
            assert target_bytes(batches, tok.token_bytes()) > 1.2 * ntok  # merged tokens span several bytes


def test_partitions_pack_documents_with_eos(tmp_path):
    corpus = _pydoc(12)
    tok = make_tokenizer("bpe", corpus, 0.1, 300, tmp_path)
    parts, val = partition_corpus(corpus, 2, "by_document", 0.1, tokenizer=tok)
    assert sum(int((p.train == tok.eos_id).sum()) for p in parts) == len(corpus.documents)
    assert int((val == tok.eos_id).sum()) == len(corpus.documents)
    byte_parts, _ = partition_corpus(corpus, 2, "by_document", 0.1)  # byte: no separator, as before
    assert sum(p.train.numel() for p in byte_parts) == sum(
        len(d.text.encode()) - int(len(d.text.encode()) * 0.1) for d in corpus.documents)


def test_client_refuses_another_tokenizer_and_noise_draws_real_ids(tiny):
    from clients.datacenter import checked_tokenizer, corpus_batches
    from clients.site import Site
    from fl_geo.config import section_to_json
    from fl_geo.runtime.builders import inner_config, tokenizer
    from strategies.base import client_config_record

    cfg = tiny("data.tokenizer=bpe", "data.bpe_vocab_size=60000", "data.noise_partitions=[0]",
               "data.noise_fraction=1.0")
    data = json.loads(client_config_record(cfg)["data"])
    tok = tokenizer(cfg.data)
    assert data["tokenizer_sha256"] == tok.sha256
    assert checked_tokenizer(data) is tok
    with pytest.raises(ValueError, match="tokenizer mismatch"):
        checked_tokenizer({**data, "tokenizer_sha256": "0" * 64})
    assert "tokenizer_sha256" not in json.loads(client_config_record(tiny())["data"])  # byte: as before
    # pydoc cannot fill 60000 tokens: the model has 60000 rows, noise must stay below the real vocabulary
    assert tok.vocab_size < cfg.model.vocab_size == 60000
    site = Site(partition_id=0, num_partitions=3, seed=0, inner=inner_config(json.loads(section_to_json(cfg.client)), 10),
                sections={"data": data, "model": json.loads(section_to_json(cfg.model))})
    sampler = corpus_batches(site)
    x, y = sampler.batch(0)
    assert sampler.is_noisy(0) and int(x.max()) < tok.vocab_size and int(y.max()) < tok.vocab_size
    assert int(x.max()) > tok.vocab_size * 0.9  # uniform draws reach the top of the range


def test_diloco_on_bpe_tokens_learns_and_reports_bpb(tmp_path, capsys):
    from fl_geo.cli import main as cli_main
    from fl_geo.compare import load_run
    from fl_geo.simulation import run_simulation

    cfg = load_config(None, [*TINY, "run.rounds=4", "run.num_clients=2", "strategy.name=diloco",
                             "data.tokenizer=bpe", "data.bpe_vocab_size=512", "client.lr=0.01"])
    summary = run_simulation(cfg, tmp_path / "bpe")
    rows = load_run(summary["run_dir"]).rows
    losses = [r["val/loss"] for r in rows if "val/loss" in r]
    assert losses[-1] < losses[0] - 0.3
    assert summary["final_val_bpb"] == pytest.approx(rows[-1]["val/bpb"])
    assert summary["final_val_bpb"] < summary["final_val_loss"] / math.log(2)  # a BPE token spans > 1 byte
    meta = json.loads((tmp_path / "bpe" / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe" and len(meta["tokenizer_sha256"]) == 64

    assert cli_main(["compare", "--runs", summary["run_dir"], "--metric", "bpb", "--out", str(tmp_path / "cmp")]) == 0
    table = capsys.readouterr().out
    assert "final val bpb" in table and f"{summary['final_val_bpb']:.4f}" in table
    assert (tmp_path / "cmp" / "val_bpb_vs_wall_time.png").is_file()
    assert cli_main(["compare", "--runs", summary["run_dir"], "--out", str(tmp_path / "cmp2")]) == 0
    table = capsys.readouterr().out
    assert "final val loss" in table and f"{summary['final_val_loss']:.4f}" in table
    # the finished run's model on its held-out text, and a continuation in the run's tokens
    assert cli_main(["eval", summary["run_dir"], "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["val_bpb"] == pytest.approx(summary["final_val_bpb"], rel=1e-5)
    assert cli_main(["sample", summary["run_dir"], "--prompt", "The ", "--tokens", "8", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("The ") and len(text) > len("The ") + 8  # 8 BPE tokens: more than 8 characters


def test_missing_tokenizers_extra_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers -> ImportError
    with pytest.raises(ConfigError, match=r"needs the `tokenizers` package: pip install 'fl-geo\[hf\]'"):
        load_config(None, ["data.tokenizer=bpe"])
