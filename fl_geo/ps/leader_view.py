"""The leader's view of a follower parameter server: the `Follower` interface the sharded Di-PS
loop (strategies/sharded.py) drives, met in process by `fl_geo.ps.follower.FollowerShard` and
over the gRPC data path by `RemoteFollower` (control calls of `fl_geo.ps.client`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Follower", "RemoteFollower"]


class Follower(Protocol):
    """What the leader asks of a follower, in process or over the data path."""

    def has(self, job: str) -> bool: ...
    def norms(self, job: str) -> list[float]: ...
    def fold(self, job: str, weight: float, rescale: float = 1.0) -> None: ...
    def drop(self, job: str) -> None: ...
    def mean_sq_sums(self, total_weight: float) -> list[float]: ...
    def step(self, clip_factor: float = 1.0, lr: float | None = None) -> int: ...
    def reset_window(self, drop_pending: bool = False) -> None: ...
    def theta_sq_sums(self) -> list[float]: ...


class RemoteFollower:
    """The `Follower` interface over the data path's control calls (`fl_geo.ps.client`)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def norms(self, job: str) -> list[float]:
        return [float(x) for x in self.client.control("norms", job=job)["sq_sums"]]

    def fold(self, job: str, weight: float, rescale: float = 1.0) -> None:
        self.client.control("fold", job=job, weight=weight, rescale=rescale)

    def drop(self, job: str) -> None:
        self.client.control("drop", job=job)

    def has(self, job: str) -> bool:
        return bool(self.client.control("has", job=job)["has"])

    def mean_sq_sums(self, total_weight: float) -> list[float]:
        return [float(x) for x in self.client.control("mean_sq_sums", total_weight=total_weight)["sq_sums"]]

    def step(self, clip_factor: float = 1.0, lr: float | None = None) -> int:
        return int(self.client.control("step", clip_factor=clip_factor, lr=lr)["version"])

    def reset_window(self, drop_pending: bool = False) -> None:
        self.client.control("reset_window", drop_pending=drop_pending)

    def theta_sq_sums(self) -> list[float]:
        return [float(x) for x in self.client.control("theta_sq_sums")["sq_sums"]]

    def pull_params(self, numel: int) -> tuple[int, torch.Tensor]:
        version, theta = self.client.pull(0, numel, wire="fp32")
        return int(version), theta
