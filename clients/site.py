"""What a user's callables learn about the node and the run: the `Site` of one message.

Plain data only (no Flower ``Context``): a `Site` is pickled into the rank processes of a
data-parallel job (``functools.partial(model_fn, site)``), and a user's code must not reach the
inner state the wrapper owns. Built from the fl-geo request and the node config by the ClientApp
wrapper (fl_geo.clients.api).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

from fl_geo.inner.training import BatchSource, InnerConfig

__all__ = ["Site", "as_batch_source"]


@dataclass(frozen=True)
class Site:
    """One node's view of one message.

    ``partition_id`` / ``num_partitions``: from the node config (simulation sets them; a
    SuperNode takes ``--node-config 'partition-id=0 num-partitions=4'``). ``seed``: the run's
    seed, the same on every node, so ``model_fn(site)`` builds the same initial model everywhere.
    ``inner``: the inner-loop settings of the run's ``client`` section (batch size, sequence
    length, learning rate, device, precision). ``sections``: the run's ``model``, ``data`` and
    ``client`` sections as dicts (what fl-geo's own decoder and corpus are built from; a user's
    model may ignore them). ``node_config`` / ``run_config``: the node's and the Flower run's config
    (``[tool.flwr.app.config]`` of the user's app: a natural place for the model's own sizes).
    ``config``: the user's own Flower ``train_config`` / ``evaluate_config`` that came with this
    message (the ``"config"`` record, fl_geo.runtime.protocol; empty when the strategy sends none); per
    message, so it is not part of `model_key`. ``eval_scope`` / ``eval_batches``: for the
    evaluate handlers, whether the server asks for this partition's held-out batches
    (``"partition"``, the ``evaluate`` message) or the global held-out set its own ``val/loss``
    uses (``"global"``, ``evaluate.stream``), and how many batches.
    """

    partition_id: int
    num_partitions: int
    seed: int
    inner: InnerConfig
    sections: Mapping[str, Any] = field(default_factory=dict)
    node_config: Mapping[str, Any] = field(default_factory=dict)
    run_config: Mapping[str, Any] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    eval_scope: str = "partition"
    eval_batches: int = 0

    def for_eval(self, scope: str, count: int) -> Site:
        """This site as seen by an evaluate handler."""
        return replace(self, eval_scope=scope, eval_batches=int(count))

    def model_key(self) -> str:
        """What identifies the model a site builds: the seed, the run's model section and the
        Flower run config (a ClientApp process caches the model under it, so a process that
        serves two runs never trains one run's model in the other)."""
        return json.dumps([self.seed, self.sections.get("model"), self.run_config], sort_keys=True, default=str)


class _CallableSource:
    """``step -> batch`` as a `BatchSource`."""

    def __init__(self, fn: Callable[[int], tuple[Any, Any]]) -> None:
        self.fn = fn

    def batch(self, step: int) -> tuple[Any, Any]:
        return self.fn(step)


class _IterableSource:
    """An iterable of batches as a `BatchSource`: replayed from its start and the first
    ``start_step`` batches skipped, so that a fresh process (deployment starts one per message)
    continues where the last round stopped. The iterable must give the same batches each time it
    is iterated (a seeded generator function, a dataset in a fixed order); an iterator that can
    only be consumed once is refused, because the next round would silently see other data."""

    def __init__(self, iterable: Iterable[tuple[Any, Any]]) -> None:
        if isinstance(iterable, Iterator):
            raise TypeError("batches_fn returned a one-shot iterator; return a re-iterable object, "
                            "a callable step -> batch, or an object with batch(step)")
        self.iterable = iterable
        self._it: Iterator[tuple[Any, Any]] | None = None
        self._next = 0

    def batch(self, step: int) -> tuple[Any, Any]:
        if self._it is None or step != self._next:
            self._it = islice(iter(self.iterable), step, None)
        self._next = step + 1
        try:
            return next(self._it)
        except StopIteration:
            raise ValueError(f"the batch source ran out of batches at step {step}") from None


def as_batch_source(obj: Any) -> BatchSource:
    """A user's batch source as a `BatchSource`: an object with ``batch(step)`` as is, a callable
    ``step -> (inputs, targets)``, or a re-iterable of batches (see `_IterableSource`)."""
    if callable(getattr(obj, "batch", None)):
        return obj
    if callable(obj):
        return _CallableSource(obj)
    if isinstance(obj, Iterable):
        return _IterableSource(obj)
    raise TypeError(f"batches_fn must return an object with batch(step), a callable or an "
                    f"iterable of batches, got {type(obj).__name__}")
