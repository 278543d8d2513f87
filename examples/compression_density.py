#!/usr/bin/env python
"""How many entries of each compressed uplink payload are nonzero once decoded, on a real run.

    .venv/bin/python examples/compression_density.py [OVERRIDES ...]

Runs DiLoCo on the eta = 100 scenario in this process (`run.backend=inline`; 12 outer steps of
H = 8 with plain averaging, 786,432 tokens) with the uplink codec the overrides name (default
``wire.compress=int2 wire.error_feedback=true``), and prints, for every payload a site encoded,
the fraction of the decoded Δ̂'s entries that are nonzero, then their mean per outer step.

Why: a dense code is not necessarily a dense update. Our int2 grid is ternary per block of 128
({-1, 0, 1} times the block's largest magnitude), so an entry below half the block's maximum is
sent as 0. This measures how sparse the update really is that the receiver applies, which tells
how many bytes an entropy-coded or a top-k code of the same update would at least need
(docs/benchmarks.md, "The outer optimizer under sparse updates").
"""

from __future__ import annotations

import sys

import torch

from fl_geo.core import compress

RUN = ["configs/bench/eta_diloco.yaml", "run.sim_cpus=1", "run.progress=false", "run.tensorboard=false",
       "run.backend=inline", "strategy.inner_steps=8", "run.rounds=12", "run.max_tokens=786432",
       "strategy.outer_lr=1.0", "strategy.outer_momentum=0.0", "wire.up=fp32", "wire.down=fp32"]
DEFAULT_CODEC = ["wire.compress=int2", "wire.error_feedback=true"]


def main(argv: list[str]) -> int:
    from fl_geo.cli import main as fl_geo_main

    fractions: list[float] = []
    encode = compress.Compressor._encode

    def counted(self: compress.Compressor, x: torch.Tensor) -> compress.Payload:
        payload = encode(self, x)
        fractions.append(float((self.decompress(payload, numel=x.numel(), device=x.device) != 0).float().mean()))
        return payload

    compress.Compressor._encode = counted  # every payload the sites of this process encode
    torch.set_num_threads(1)
    overrides = argv or DEFAULT_CODEC
    rc = fl_geo_main(["run", *RUN, *overrides, "run.name=compression-density", "--out", "runs/compression-density"])
    sites = 4
    print("nonzero fraction of each decoded payload:", " ".join(f"{f:.3f}" for f in fractions))
    for step in range(0, len(fractions), sites):
        chunk = fractions[step: step + sites]
        print(f"outer step {step // sites + 1}: mean {sum(chunk) / len(chunk):.3f}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
