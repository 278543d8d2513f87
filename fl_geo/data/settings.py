"""The ``data`` section: which corpus, how it is split into datacenter partitions, the tokenizer
and the injected noise.

`fl_geo.data` reads every key (through `fl_geo.runtime.builders`). The checks that need only this
section (known corpus, partition scheme and noise kind, ranges, the files a local corpus needs)
live here; the noisy partitions against ``run.num_clients`` and the tokenizer's vocabulary
against the model read other sections and are checked in `fl_geo.config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fl_geo.data.corpus import CORPUS_NAMES
from fl_geo.errors import require

# The kinds of injected batch noise (`fl_geo.data.loader.BatchNoise`), named here so that the
# config schema needs no torch.
NOISE_KINDS = ("random", "shuffle")


@dataclass
class DataSection:
    """Corpus, partitioning and batch shape (fl_geo.data)."""

    corpus: str = "auto"  # auto | bible | shakespeare | stdlib | pydoc | files | jsonl | parquet | arrow
    data_dir: str = ""  # "" = $FL_GEO_DATA_DIR or ~/.cache/fl-geo/corpora
    files: list[str] = field(default_factory=list)
    text_key: str = "text"
    partition: str = "by_group"  # by_group (natural non-IID) | iid | by_document
    val_fraction: float = 0.05
    seed: int = 0
    # Low-quality training batches in bursts (EDiT-style loss spikes); validation data stays clean.
    noise_partitions: list[int] = field(default_factory=list)  # partition ids whose batches are corrupted
    noise_fraction: float = 0.0  # probability that a block of batches is corrupted
    noise_kind: str = "random"  # random (uniform token ids) | shuffle (real windows, tokens permuted)
    noise_block: int = 1  # consecutive inner steps sharing one corrupt/clean decision
    noise_shared: bool = False  # true: every noisy partition is corrupted in the same blocks
    # byte (UTF-8 bytes, vocabulary 256) | bpe (byte-level BPE trained on the training text, cached) |
    # a directory holding tokenizer.json; model.vocab_size follows the tokenizer (docs/data.md)
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    # data.corpus=jsonl|parquet|arrow: local files read through `datasets` (a file, glob or directory)
    path: str = ""
    text_field: str = "text"

    def check(self) -> None:
        """Raise `ConfigError` for an unknown corpus, scheme or noise kind, a missing source, or a
        value out of its range."""
        require(self.partition in ("by_group", "iid", "by_document"),
                f"data.partition '{self.partition}' is unknown; valid: by_group, iid, by_document")
        require(0 < self.val_fraction < 0.5, f"data.val_fraction must be in (0, 0.5), got {self.val_fraction}")
        require(self.corpus in CORPUS_NAMES, f"data.corpus '{self.corpus}' is unknown; valid: {', '.join(CORPUS_NAMES)}")
        require(self.corpus != "files" or bool(self.files), "data.corpus=files needs data.files (paths or globs of .txt/.jsonl)")
        require(self.corpus not in ("jsonl", "parquet", "arrow") or bool(self.path),
                f"data.corpus={self.corpus} needs data.path (a local file, glob or directory)")
        require(bool(self.text_field), "data.text_field must name the column that holds the text")
        require(0 <= self.noise_fraction <= 1, f"data.noise_fraction must be in [0, 1], got {self.noise_fraction}")
        require(self.noise_kind in NOISE_KINDS, f"data.noise_kind must be one of {NOISE_KINDS}, got '{self.noise_kind}'")
        require(self.noise_block >= 1, f"data.noise_block must be >= 1, got {self.noise_block}")
        require(len(set(self.noise_partitions)) == len(self.noise_partitions),
                f"data.noise_partitions has duplicates: {self.noise_partitions}")
