"""The data-parallel job's shared-memory contract between the parent and its rank processes.

:class:`SharedTrainState` holds θ and the inner optimizer's state (AdamW's moments, or Muon's
momentum for the hidden matrices under ``client.optimizer: muon``) in shared-memory tensors in one flat
`ParamSpec` layout: the parent (`fl_geo.inner.distributed`) fills and reads them, rank 0
(`fl_geo.inner.distributed_rank`) writes the trained values back. The layout helpers
(:func:`model_spec`, :func:`spec_of`) and the model factories (:func:`config_model`,
:func:`as_factory`) are here because both sides need them. Separate from the launcher and the
rank loop so that each side imports the contract, not the other side. Importable without Flower.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from fl_geo.core.state import ParamSpec, flatten, unflatten
from fl_geo.inner.model import Decoder, ModelConfig
from fl_geo.inner.muon import hidden_matrices
from fl_geo.inner.training import InnerTrainer, state_keys

__all__ = ["ModelFactory", "SharedStateTrainer", "SharedTrainState", "as_factory", "config_model", "matrices_of", "model_spec", "spec_of"]

# Builds the site's model (its initial values are overwritten by the shared parameters). Must be
# picklable (a module-level function or a functools.partial of one): the ranks are spawned.
ModelFactory = Callable[[], torch.nn.Module]

# Result slots rank 0 writes for the parent: steps, tokens, mean loss, step time, final loss.
_RESULT_FIELDS = 5


def model_spec(model_cfg: ModelConfig) -> ParamSpec:
    """The flat layout of the model, from a parameter-less (``meta``) instance.

    The parent of a data-parallel job needs the layout, not a model: building a real one there
    would allocate and initialise a model-sized copy that nobody trains.
    """
    return spec_of(functools.partial(config_model, model_cfg))


def _layout_model(factory: ModelFactory) -> torch.nn.Module:
    """``factory()``'s model, built on the ``meta`` device when it allows it (no memory, no random
    draws), else for real with the global RNG state preserved."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return factory()
        except Exception:  # noqa: BLE001 - a model that cannot be built on meta: build it for real
            return factory()


def spec_of(factory: ModelFactory) -> ParamSpec:
    """The flat layout of ``factory()``'s model (built on ``meta`` where it can be)."""
    return ParamSpec.from_state_dict(_layout_model(factory).state_dict())


def matrices_of(factory: ModelFactory) -> frozenset[str]:
    """The parameters Muon trains in ``factory()``'s model (`fl_geo.inner.muon.hidden_matrices`),
    from the same ``meta`` build: the rule reads module types and shapes only."""
    return frozenset(hidden_matrices(_layout_model(factory)))


def config_model(model_cfg: ModelConfig) -> torch.nn.Module:
    """The model of a ``model`` section, initial values unspecified (the job's shared buffer
    overwrites them): fl-geo's decoder, or a Hugging Face model for ``kind: hf``."""
    if model_cfg.kind == "hf":
        from fl_geo.inner.hf import build_hf_model

        return build_hf_model(model_cfg, 0)
    return Decoder(model_cfg)


def as_factory(model: ModelConfig | ModelFactory) -> ModelFactory:
    """A ModelFactory for a ``model`` section (`config_model`) or a user's factory (returned as is)."""
    return functools.partial(config_model, model) if isinstance(model, ModelConfig) else model



@dataclass
class SharedTrainState:
    """Model and inner optimizer state in shared memory: written by the parent, trained by rank 0.

    ``params`` holds θ in the flat ``spec`` layout (the global model on the way in, the trained
    local model on the way out). The moments use the same layout, so an entry's optimizer state
    sits at its parameter's offset; ``steps`` holds one AdamW step count per ``spec`` entry.
    ``matrices`` (``client.optimizer: muon``) names the entries Muon steps: their one state
    tensor, the momentum buffer, sits in ``exp_avg`` (their ``exp_avg_sq`` and step are unused).
    ``has_moments`` is 0 until the first step (an empty state, as ``InnerTrainer`` exports it).
    """

    spec: ParamSpec
    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor
    has_moments: torch.Tensor
    result: torch.Tensor
    matrices: frozenset[str] = frozenset()

    @classmethod
    def allocate(cls, spec: ParamSpec, matrices: frozenset[str] = frozenset()) -> SharedTrainState:
        """Fresh (uninitialised) shared buffers; ``params`` must be filled by the caller."""

        def shared(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.empty(n, dtype=dtype).share_memory_()

        return cls(
            spec=spec,
            params=shared(spec.numel),
            exp_avg=shared(spec.numel),
            exp_avg_sq=shared(spec.numel),
            steps=shared(len(spec.names)),
            has_moments=shared(1, torch.uint8).zero_(),
            result=shared(_RESULT_FIELDS, torch.float64).zero_(),
            matrices=frozenset(matrices),
        )

    @classmethod
    def map_files(cls, spec: ParamSpec, directory: str) -> SharedTrainState:
        """The buffers as files in ``directory`` mapped ``MAP_SHARED`` (created zeroed if absent).

        For processes that are not each other's children (a site group's coordinator and its
        ranks, `fl_geo.clients.site_group`): a ``share_memory_()`` tensor can only be handed to a
        process this one starts, a named file can be mapped by anyone who knows its path. Put
        ``directory`` on a tmpfs (``/dev/shm``) so that the pages never go to disk. Every
        process must map the files with the same ``spec`` (the sizes are not re-checked).
        """

        def mapped(name: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.from_file(os.path.join(directory, name), shared=True, size=n, dtype=dtype)

        return cls(
            spec=spec,
            params=mapped("params", spec.numel),
            exp_avg=mapped("exp_avg", spec.numel),
            exp_avg_sq=mapped("exp_avg_sq", spec.numel),
            steps=mapped("steps", len(spec.names)),
            has_moments=mapped("has_moments", 1, torch.uint8),
            result=mapped("result", _RESULT_FIELDS, torch.float64),
        )

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """``InnerTrainer.optimizer_state`` layout, as *views* of the shared buffers (no copy).

        Empty before the first step. Callers that keep the dict beyond the buffers' next use
        must copy (a Flower ``Array`` built from it does).
        """
        if not int(self.has_moments[0]):
            return {}
        flat: dict[str, torch.Tensor] = {}
        avg, avg_sq = unflatten(self.exp_avg, self.spec), unflatten(self.exp_avg_sq, self.spec)
        for index, name in enumerate(self.spec.names):
            if name in self.matrices:
                flat[f"{name}.momentum_buffer"] = avg[name]
                continue
            flat[f"{name}.exp_avg"] = avg[name]
            flat[f"{name}.exp_avg_sq"] = avg_sq[name]
            flat[f"{name}.step"] = self.steps[index]
        return flat

    def load_optimizer_state(self, flat: Mapping[str, torch.Tensor]) -> None:
        """Copy an ``InnerTrainer.optimizer_state()`` dict in; empty means no state yet.

        Validated like ``InnerTrainer.load_optimizer_state`` so that a stale state from another
        model fails here, in the parent, rather than in every rank.
        """
        if not flat:
            self.has_moments.zero_()
            return
        expected = state_keys(self.spec.names, self.matrices)
        if set(flat) != expected:
            missing = sorted(expected - set(flat))[:5]
            extra = sorted(set(flat) - expected)[:5]
            raise ValueError(
                f"optimizer state does not match the model: missing {missing}, unexpected {extra}"
            )
        for name, shape in zip(self.spec.names, self.spec.shapes, strict=True):
            for key in ("momentum_buffer",) if name in self.matrices else ("exp_avg", "exp_avg_sq"):
                if tuple(flat[f"{name}.{key}"].shape) != shape:
                    raise ValueError(
                        f"optimizer state {name}.{key} has shape "
                        f"{tuple(flat[f'{name}.{key}'].shape)}, parameter has {shape}"
                    )
        avg, avg_sq = unflatten(self.exp_avg, self.spec), unflatten(self.exp_avg_sq, self.spec)
        with torch.no_grad():
            for index, name in enumerate(self.spec.names):
                if name in self.matrices:
                    avg[name].copy_(flat[f"{name}.momentum_buffer"])
                    continue
                avg[name].copy_(flat[f"{name}.exp_avg"])
                avg_sq[name].copy_(flat[f"{name}.exp_avg_sq"])
                self.steps[index] = float(torch.as_tensor(flat[f"{name}.step"]).reshape(()))
        self.has_moments.fill_(1)

    def _store_from(self, trainer: InnerTrainer) -> None:
        """Rank 0: copy the trained parameters and optimizer state into the buffers (device → host)."""
        flatten(trainer.model.state_dict(), self.spec, out=self.params)
        views = {
            "exp_avg": unflatten(self.exp_avg, self.spec),
            "exp_avg_sq": unflatten(self.exp_avg_sq, self.spec),
        }
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            for name, param in zip(trainer.param_names, params, strict=True):
                state = trainer.optimizer.state[param]
                if name in self.matrices:
                    views["exp_avg"][name].copy_(state["momentum_buffer"])
                    continue
                for key, view in views.items():
                    view[name].copy_(state[key])
                self.steps[self.spec.index(name)] = float(torch.as_tensor(state["step"]))
        self.has_moments.fill_(1)


class SharedStateTrainer:
    """What a trainer whose state lives in a `SharedTrainState` (``self.shared``) offers the
    ClientApp's handler as `InnerTrainer` does: θ as a flat buffer, and the optimizer state in and
    out. The ranks spawned per message (`fl_geo.inner.distributed.DataParallelTrainer`) and a site
    group's job (`fl_geo.clients.site_group.SiteGroupTrainer`) both are one."""

    shared: SharedTrainState

    @property
    def params(self) -> torch.Tensor:
        """θ in the shared buffer: the global model before ``train``, the local model after."""
        return self.shared.params

    def load_optimizer_state(self, flat: Mapping[str, torch.Tensor]) -> None:
        self.shared.load_optimizer_state(flat)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        return self.shared.optimizer_state()
