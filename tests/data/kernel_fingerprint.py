"""A short digest of this machine's float kernels: the key under which exact bits are recorded.

Why: the same torch wheel picks different kernels on different CPUs (AVX2 or AVX-512 code paths in
ATen, MKL and oneDNN), so the last bits of a training run depend on the CPU, not only on
``platform.machine()``. Two machines whose fingerprints agree computed the probe below bit for bit
and are expected to agree on the tiny training runs too; anywhere else the bit-identity test
compares the runs' float64 statistics with a tolerance instead.

The probe touches the kernels a training step of the built-in decoder uses: fp32 and bf16 matrix
products (MKL / oneDNN), softmax, layer norm, GELU, exp/log, a long reduction and a fused AdamW
step, all on seeded inputs, with the two threads the tiny runs use.

``FL_GEO_KERNEL_FINGERPRINT`` overrides the computed value; set it to any string (say ``other``) to
run the suite as a machine with kernels nobody recorded would (the tolerance path).
"""

from __future__ import annotations

import functools
import hashlib
import os

ENV_OVERRIDE = "FL_GEO_KERNEL_FINGERPRINT"


def _probe_outputs() -> list:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(1234)
    a = torch.randn(67, 129, generator=gen)
    b = torch.randn(129, 61, generator=gen)
    x = torch.randn(8, 33, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    outs = [
        a @ b,
        (a.bfloat16() @ b.bfloat16()).float(),
        torch.softmax(x, dim=-1),
        F.layer_norm(x, (64,), weight=w, bias=w.flip(0)),
        F.gelu(x),
        torch.exp(x).log1p(),
        torch.randn(100_003, generator=gen).cumsum(0)[-1:] + torch.randn(100_003, generator=gen).sum(),
        F.linear(x, torch.randn(96, 64, generator=gen)),
    ]
    p = torch.nn.Parameter(torch.randn(4099, generator=gen))
    p.grad = torch.randn(4099, generator=gen)
    opt = torch.optim.AdamW([p], lr=1e-2, fused=False, foreach=True)
    for _ in range(3):
        opt.step()
    outs.append(p.detach())
    return outs


@functools.cache
def kernel_fingerprint() -> str:
    """16 hex digits naming this machine's float kernels (or the ``FL_GEO_KERNEL_FINGERPRINT`` value)."""
    forced = os.environ.get(ENV_OVERRIDE)
    if forced:
        return forced
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        digest = hashlib.sha256()
        for out in _probe_outputs():
            digest.update(out.contiguous().numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
    return digest.hexdigest()[:16]


def kernel_description() -> dict[str, str]:
    """What a reader needs to tell the recorded machine apart: the fingerprint and its ingredients."""
    import platform

    import torch

    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        cpu = platform.processor()
    return {"fingerprint": kernel_fingerprint(), "machine": platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": cpu, "torch": torch.__version__}
