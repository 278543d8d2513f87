#!/usr/bin/env python
"""How large is CoCoDC's delay compensation on the streaming proxy? (docs/benchmarks.md)

    .venv/bin/python examples/cocodc_compensation_magnitude.py [CONFIG] [key=value ...]

(default: configs/cocodc.yaml data.corpus=bible; the scale ladder passes its model sizes and BPE
tokenizer as overrides.)

One worker of configs/cocodc.yaml trains 95 AdamW steps (t_p), then τ = 5 more (t_l). The new
global fragment is stood in for by θ(t_p) + D with D = θ(0) − θ(t_p), the worker's own drift over
the period (an upper-end size for θ^g − θ^m(t_p)). Prints ‖d‖, ‖D‖ and the norm of the
correction λ·d⊙d⊙D/(τH) that `fl_geo.core.streaming.cocodc_compensate` adds on top of "global + local
progress", and its ratio to the local progress d it corrects: once as the fp32 difference of the
merged fragment and global + d (what the model actually receives, rounding included), once from
the formula in float64 (the term itself: it can lie below fp32 resolution of θ).
"""

from __future__ import annotations

import json
import sys

import torch

from fl_geo.clients.datacenter import make_sampler
from fl_geo.config import load_config, schedule_length, section_to_json, to_dict, warmup_length
from fl_geo.core.state import flatten
from fl_geo.core.streaming import cocodc_compensate
from fl_geo.inner.training import InnerTrainer
from fl_geo.runtime.builders import inner_config, make_model, partitions


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one core: a second thread spins when another process holds it
    args = sys.argv[1:]
    path = args.pop(0) if args and "=" not in args[0] else "configs/cocodc.yaml"
    cfg = load_config(path, ["data.corpus=bible", *args])
    model = make_model(cfg.model, 0)
    client = json.dumps({**to_dict(cfg.client), "warmup_steps": warmup_length(cfg)})
    icfg = inner_config(client, schedule_length(cfg))
    parts, _ = partitions(section_to_json(cfg.data), cfg.run.num_clients)
    sampler = make_sampler(json.loads(section_to_json(cfg.data)), parts[0].train, icfg, 0, model.cfg.vocab_size, 1)
    trainer = InnerTrainer(model, icfg)
    H, tau, lam = cfg.strategy.inner_steps, cfg.streaming.overlap, cfg.streaming.compensation

    start = flatten(model.state_dict()).clone()
    trainer.train(sampler, H - tau, 0)
    at_tp = flatten(model.state_dict()).clone()
    trainer.train(sampler, tau, H - tau)
    at_tl = flatten(model.state_dict()).clone()

    d, drift = at_tl - at_tp, start - at_tp
    new_global = at_tp + drift
    merged = cocodc_compensate(at_tp, at_tl, new_global, tau=tau, H=H, lam=lam)
    correction = merged - (new_global + d)
    exact = d.double().square().mul(drift.double()).mul(lam / (tau * H))
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters: |d| = {d.norm():.4e}  "
          f"|D| = {drift.norm():.4e}  |correction| = {correction.norm():.4e} (fp32 merge; "
          f"ratio {correction.norm() / d.norm():.2e}), {exact.norm():.4e} (float64 formula; "
          f"ratio {exact.norm() / d.double().norm():.2e})  (lambda {lam}, tau {tau}, H {H})")


if __name__ == "__main__":
    main()
