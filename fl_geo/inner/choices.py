"""The names the config accepts for the inner loop: optimizers, Muon's learning-rate adjustment,
device kinds and precisions.

Plain constants in a module that imports nothing: the config schema, the deployment topology and
the command line read them, and ``fl-geo --help`` or ``fl-geo data fetch`` should not pay torch's
import (~3 CPU-s) to list them. The modules that act on them (`fl_geo.inner.muon`,
`fl_geo.inner.device`) take them from here.
"""

from __future__ import annotations

__all__ = ["ADJUST_LR", "DEVICE_KINDS", "OPTIMIZERS", "PRECISIONS"]

OPTIMIZERS = ("adamw", "muon")  # client.optimizer
ADJUST_LR = ("original", "match_rms_adamw")  # client.muon_adjust_lr: torch.optim.Muon's adjust_lr_fn
DEVICE_KINDS = ("auto", "cuda", "npu", "mps", "cpu")  # client.device, a topology node's device
PRECISIONS = ("auto", "bf16", "fp32")  # client.precision
