"""The ``client`` section: the inner loop every datacenter ClientApp runs, and on which devices.

The server sends the section with each job and the ClientApp (`fl_geo.clients.api`) builds its
inner trainer and picks its devices from it. The checks of the section alone (optimizer ranges,
a device and precision the trainer knows, the data-parallel backend) live here, imported by the
config schema without importing a ClientApp; ``client.seq_len`` against the model's positions
reads the ``model`` section and is checked in `fl_geo.config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_geo.errors import require
from fl_geo.inner.choices import ADJUST_LR, OPTIMIZERS


@dataclass
class ClientSection:
    """Inner loop of every datacenter client (fl_geo.inner.training.InnerConfig)."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 0  # schedule length; 0 = rounds * inner_steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    batch_size: int = 16  # per process: with devices = N a site trains on N x batch_size sequences a step
    seq_len: int = 128
    device: str = "auto"  # auto | cuda | npu | mps | cpu
    precision: str = "auto"  # auto (bf16 autocast on accelerators) | bf16 | fp32
    eval_batches: int = 8
    # The inner optimizer (docs/algorithms.md §1, fl_geo.inner.muon): adamw, or muon = Muon on the
    # hidden matrices (2-D, not embeddings, not the output head) and the AdamW above on the rest,
    # both on the one warm-up / cosine schedule (Muon's peak is muon_lr).
    optimizer: str = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations per step (torch allows 1..99)
    muon_weight_decay: float = 0.01  # θ·(1 − lr·wd) a step: 2e-4 at lr 0.02, AdamW's default is 3e-4
    muon_adjust_lr: str = "original"  # original (√max(1, rows/cols)) | match_rms_adamw (0.2·√max(rows, cols))
    # Data-parallel inner loop over a site's devices (fl_geo.inner.distributed, docs/multidevice.md):
    # 1 = one process (the default path); N > 1 = N DDP processes started per train message. A
    # SuperNode may override it (--node-config 'devices=8'); its hardware is checked there.
    devices: int = 1
    # Nodes of a site (docs/multidevice.md): N > 1 = the site's persistent group spans N nodes of
    # `devices` ranks each (node config site-group and site-rendezvous on node 0, the agent
    # fl_geo.clients.site_node on the others); a SuperNode may override it (node config nodes).
    nodes: int = 1
    dist_backend: str = "auto"  # auto (nccl on CUDA, gloo on CPU) | gloo | nccl
    # How the ranks split the model (docs/multidevice.md): ddp = a whole replica per rank; fsdp =
    # FSDP2 shards (parameters, gradients and AdamW moments 1/N per rank: a model larger than one device)
    parallel: str = "ddp"
    # Recompute each repeated block's forward during backward (fl_geo.inner.blocks): the activations
    # kept for backward drop to one tensor per block, for about one more forward pass of compute
    activation_checkpointing: bool = False

    def _check_optimizer(self) -> None:
        """Raise `ConfigError` for an inner optimizer, schedule or batch setting out of its range."""
        require(self.lr > 0 and self.batch_size >= 1 and self.seq_len >= 2, "client.lr, batch_size and seq_len must be positive")
        require(0 <= self.min_lr_ratio <= 1, f"client.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        require(self.warmup_steps >= 0 and self.total_steps >= 0,
                f"client.warmup_steps and client.total_steps must be >= 0, got {self.warmup_steps} and {self.total_steps}")
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
                f"client.beta1 and client.beta2 must be in [0, 1), got {self.beta1} and {self.beta2}")
        require(self.eps > 0, f"client.eps must be > 0, got {self.eps}")
        require(self.weight_decay >= 0 and self.grad_clip >= 0,
                f"client.weight_decay and client.grad_clip must be >= 0 (0 = off), got {self.weight_decay} and {self.grad_clip}")
        require(self.eval_batches >= 1, f"client.eval_batches must be >= 1, got {self.eval_batches}")
        self._check_muon()

    def _check_muon(self) -> None:
        """Raise `ConfigError` for an unknown inner optimizer or a Muon setting out of its range."""
        require(self.optimizer in OPTIMIZERS,
                f"client.optimizer '{self.optimizer}' is unknown; valid: {', '.join(OPTIMIZERS)}")
        require(self.muon_lr > 0, f"client.muon_lr must be > 0, got {self.muon_lr}")
        require(0 <= self.muon_momentum < 1, f"client.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        require(1 <= self.muon_ns_steps <= 99, f"client.muon_ns_steps must be in 1..99, got {self.muon_ns_steps}")
        require(self.muon_weight_decay >= 0, f"client.muon_weight_decay must be >= 0, got {self.muon_weight_decay}")
        require(self.muon_adjust_lr in ADJUST_LR,
                f"client.muon_adjust_lr '{self.muon_adjust_lr}' is unknown; valid: {', '.join(ADJUST_LR)}")

    def _check_devices(self) -> None:
        """Raise `ConfigError` for a device, precision or data-parallel setting the trainer does not
        know (the hardware itself is checked where the client runs)."""
        kind, _, index = self.device.partition(":")
        require(kind in ("auto", "cuda", "npu", "mps", "cpu") and (not index or (index.isdigit() and kind in ("cuda", "npu"))),
                f"client.device '{self.device}' is unknown; valid: auto, cuda, cuda:N, npu, npu:N, mps, cpu")
        require(self.precision in ("auto", "bf16", "fp32"), f"client.precision '{self.precision}' is unknown")
        require(self.devices >= 1, f"client.devices must be >= 1, got {self.devices}")
        require(self.nodes >= 1, f"client.nodes must be >= 1, got {self.nodes}")
        require(self.dist_backend in ("auto", "gloo", "nccl"),
                f"client.dist_backend must be auto, gloo or nccl, got '{self.dist_backend}'")
        require(self.dist_backend != "nccl" or kind in ("auto", "cuda"),
                f"client.dist_backend=nccl needs CUDA devices, but client.device is '{self.device}'")
        require(self.parallel in ("ddp", "fsdp"), f"client.parallel must be ddp or fsdp, got '{self.parallel}'")
        require(not (self.parallel == "fsdp" and self.optimizer != "adamw"),
                f"client.parallel=fsdp shards AdamW's state only; client.optimizer={self.optimizer} needs client.parallel=ddp")
        require(self.devices == 1 or self.device in ("auto", "cuda", "cpu"),
                f"client.devices > 1 runs on cuda or cpu, not on client.device '{self.device}'")

    def check(self) -> None:
        """Raise `ConfigError` for any value of this section that no client could run with."""
        self._check_optimizer()
        self._check_devices()
