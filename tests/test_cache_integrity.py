"""Caches are checked before use (issue 26, "verified caches"): the trained-BPE cache entry and the
token store. Each tampering case is rebuilt with a WARNING naming the file, never used silently and
never a traceback; the rebuilt result equals a clean build. Synthetic corpora only (no fetch)."""

from __future__ import annotations

import errno
import json
import logging
from pydoc_data.topics import topics

import numpy as np
import pytest

import fl_geo.data.store as store_mod
import fl_geo.data.store_check as check_mod
from fl_geo.data import ByteTokenizer
from fl_geo.data.corpus import Corpus, Document, corpus_digest
from fl_geo.data.partition import make_tokenizer
from fl_geo.data.store import build_store
from fl_geo.errors import OutputError

pytest.importorskip("tokenizers")


@pytest.fixture(autouse=True)
def _warnings_reach_caplog(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger("fl_geo"), "propagate", True)
    caplog.set_level(logging.WARNING, logger="fl_geo")
    check_mod.forget_verified()


def _corpus(count: int = 24, offset: int = 0) -> Corpus:
    keys = sorted(topics)[offset:offset + count]
    docs = [Document(name=f"d{i}", group=f"g{i % 3}", text=topics[k]) for i, k in enumerate(keys)]
    return Corpus(name="synthetic", documents=docs, sha256=corpus_digest(docs))


def _warnings(caplog) -> list[str]:
    return list(dict.fromkeys(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING))


# ---- the BPE cache entry ------------------------------------------------------------------------
def _only_entry(cache):
    (path,) = list((cache / "tokenizers").glob("bpe-*.json"))
    return path


def _tamper_cases():
    def other_valid_tokenizer(path, tmp_path):
        other = make_tokenizer("bpe", _corpus(offset=40), 0.05, 300, tmp_path / "other")
        path.write_bytes(_only_entry(tmp_path / "other").read_bytes())  # a verified entry, of other text
        return other.sha256

    def bare_tokenizer_file(path, tmp_path):
        other = make_tokenizer("bpe", _corpus(offset=40), 0.05, 300, tmp_path / "other")
        other.tok.save(str(path))  # a valid tokenizers file, as format 1 wrote it
        return other.sha256

    def edited_vocabulary(path, tmp_path):
        entry = json.loads(path.read_text())
        text = entry["tokenizer"]
        swapped = text.replace('"!":1,"\\"":2', '"!":2,"\\"":1', 1)  # two ids swapped, sha256 left alone
        assert swapped != text
        entry["tokenizer"] = swapped
        path.write_text(json.dumps(entry))
        return None

    def garbage(path, tmp_path):
        path.write_bytes(b"\x00\xff garbage" * 100)
        return None

    def truncated(path, tmp_path):
        path.write_bytes(path.read_bytes()[:1000])
        return None

    return {"another valid tokenizer": (other_valid_tokenizer, "its key differs"),
            "a bare tokenizers file": (bare_tokenizer_file, "not an fl-geo BPE cache entry"),
            "an edited vocabulary": (edited_vocabulary, "does not match the sha256"),
            "garbage": (garbage, "not JSON"), "truncated": (truncated, "not JSON")}


@pytest.mark.parametrize("case", list(_tamper_cases()))
def test_a_tampered_bpe_cache_entry_is_refused_and_rebuilt(tmp_path, caplog, case):
    corpus = _corpus()
    clean = make_tokenizer("bpe", corpus, 0.05, 300, tmp_path / "cache")
    path = _only_entry(tmp_path / "cache")
    good_bytes = path.read_bytes()
    tamper, reason = _tamper_cases()[case]
    foreign_sha = tamper(path, tmp_path)
    assert make_tokenizer("bpe", corpus, 0.05, 300, tmp_path / "cache").sha256 == clean.sha256 != foreign_sha
    (warning,) = _warnings(caplog)
    assert warning.startswith(f"fl-geo: BPE cache {path} refused (") and reason in warning
    assert path.read_bytes() == good_bytes  # replaced by the rebuilt entry (training is deterministic)
    caplog.clear()
    make_tokenizer("bpe", corpus, 0.05, 300, tmp_path / "cache")
    assert _warnings(caplog) == []  # and that entry is used as it is


def test_an_intact_bpe_cache_entry_is_used_without_training(tmp_path, monkeypatch):
    corpus = _corpus()
    first = make_tokenizer("bpe", corpus, 0.05, 300, tmp_path / "cache")
    import tokenizers

    def no_training(*args, **kwargs):
        raise AssertionError("trained again although the cache entry verifies")

    monkeypatch.setattr(tokenizers.Tokenizer, "train_from_iterator", no_training)
    assert make_tokenizer("bpe", corpus, 0.05, 300, tmp_path / "cache").sha256 == first.sha256


# ---- the token store ----------------------------------------------------------------------------
def _store(tmp_path):
    return build_store(_corpus(), ByteTokenizer(), 0.1, tmp_path / "stores")


def _flip_one_percent(store):
    path = store.directory / "train.bin"
    ids = np.fromfile(path, dtype=np.uint8)
    rng = np.random.default_rng(0)
    where = rng.choice(len(ids), size=len(ids) // 100, replace=False)
    ids[where] ^= 0x20
    ids.tofile(path)


def _edit_meta(field, value):
    def edit(store):
        path = store.directory / "meta.json"
        meta = json.loads(path.read_text())
        meta[field] = value
        path.write_text(json.dumps(meta))
    return edit


def _swap_in(name):
    def edit(store):
        (store.directory / name).write_bytes(b"\x00" * (store.directory / name).stat().st_size)
    return edit


STORE_CASES = {
    "1 % of the ids flipped": (_flip_one_percent, "train.bin does not match the sha256 recorded"),
    "meta.json says 100 tokens": (_edit_meta("train_tokens", 100), "ids of uint8, meta.json says 100"),
    "meta.json of another tokenizer": (_edit_meta("tokenizer_sha256", "0" * 64), "tokenizer_sha256 is"),
    "meta.json garbage": (lambda s: (s.directory / "meta.json").write_bytes(b"{\xff"), "is unreadable or not JSON"),
    "index.npz zeroed": (_swap_in("index.npz"), "index.npz does not load"),
    "val.bin truncated": (lambda s: (s.directory / "val.bin").write_bytes(b"ab"), "val.bin holds 2 bytes"),
}


@pytest.mark.parametrize("case", list(STORE_CASES))
def test_a_damaged_token_store_is_refused_and_rebuilt(tmp_path, caplog, case):
    clean = _store(tmp_path)
    train, val = np.array(clean.train), np.array(clean.val)
    assert _warnings(caplog) == []
    damage, reason = STORE_CASES[case]
    damage(clean)
    again = _store(tmp_path)  # same process: the once-per-process memory must not hide the damage
    (warning,) = _warnings(caplog)
    assert warning.startswith("fl-geo: token store refused (") and reason in warning
    assert str(clean.directory) in warning
    assert again.directory == clean.directory
    assert np.array_equal(np.array(again.train), train) and np.array_equal(np.array(again.val), val)
    assert sorted(p.name for p in (tmp_path / "stores").iterdir()) == [clean.directory.name]  # nothing left aside


def test_a_store_is_hashed_once_per_process(tmp_path, monkeypatch):
    _store(tmp_path)
    check_mod.forget_verified()
    hashed = []
    real = check_mod.sha256_of
    monkeypatch.setattr(check_mod, "sha256_of", lambda path: hashed.append(path.name) or real(path))
    for _ in range(3):
        _store(tmp_path)
    assert sorted(hashed) == ["index.npz", "train.bin", "val.bin"]


def test_a_full_disk_while_building_a_store_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.np, "savez", full)  # after the ids are written, before meta.json
    with pytest.raises(OutputError, match=r"cannot write the token store .*tokens-\w+: No space left on device"):
        _store(tmp_path)
    assert list((tmp_path / "stores").iterdir()) == []
