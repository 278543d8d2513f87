"""Train DiLoCo on your own text: every file (or JSONL `text` field) becomes a document, grouped
by file name, and `by_group` partitioning gives each simulated datacenter its own files.

    .venv/bin/python examples/own_text.py 'notes/*.txt' chats.jsonl [key=value ...]
"""

from __future__ import annotations

import sys

from fl_geo.config import load_config
from fl_geo.simulation import run_simulation


def main(argv: list[str]) -> None:
    files = [a for a in argv if "=" not in a]
    overrides = [a for a in argv if "=" in a]
    if not files:
        raise SystemExit(__doc__)
    cfg = load_config(
        None,
        ["data.corpus=files", f"data.files=[{','.join(files)}]", "run.name=own-text", "run.rounds=10", *overrides],
    )
    summary = run_simulation(cfg)
    print(f"final val loss {summary['final_val_loss']:.4f} nats/byte; metrics in {summary['run_dir']}")


if __name__ == "__main__":
    main(sys.argv[1:])
