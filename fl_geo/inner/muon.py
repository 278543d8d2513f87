"""Muon for a model's hidden matrices, AdamW for the rest: the inner optimizer ``client.optimizer: muon``.

MuLoCo (Thérien et al. 2025) runs DiLoCo with Muon as the inner optimizer and finds that its
pseudo-gradients survive aggressive compression better than AdamW's; this module lets fl-geo study
compression × inner optimizer on any model. Muon (Jordan et al. 2024, "Muon: an optimizer for
hidden layers in neural networks"; Liu et al. 2025, "Muon is scalable for LLM training") replaces
each update of a 2-D weight by the orthogonalised momentum (Newton-Schulz iterations), which only
makes sense for a matrix that maps one hidden representation to another. Muon practice, followed
here, gives everything else to AdamW:

- **embeddings** (an ``nn.Embedding`` / ``nn.EmbeddingBag`` weight): a lookup table, each row
  updated only by its own tokens; orthogonalising the table's update couples rows that share no
  input, and its "input space" is one-hot;
- **the output head**: its rows are per-class logit scales that Muon's uniform singular values
  would flatten (both papers keep it on AdamW; with a tied head it *is* the embedding);
- **vectors and scalars** (norm gains, biases) and tensors of three or more dimensions: Muon is
  defined for matrices only (``torch.optim.Muon`` refuses anything but 2-D).

The rule (`hidden_matrices`), applied to ``model.named_parameters()``: a parameter is a hidden
matrix when it is 2-D, is not a parameter of an embedding module, and is not the output head's.
The head is the module ``get_output_embeddings()`` returns (Hugging Face's convention; fl-geo's
decoder and `CausalLM` answer it too); a model without that method is taken to be a plain stack
whose head is its last 2-D parameter in registration order. Exclusion is by tensor identity, so a
head tied to the embedding is the embedding. A model whose head is elsewhere either defines
``get_output_embeddings`` or passes its own list (``muon_optimizer(model, cfg, matrices=[...])``).

Both optimizers follow the inner loop's one learning-rate schedule: a Muon group carries
``lr_scale = muon_lr / lr`` (`LR_SCALE`), and the inner loop sets every group's lr to the
schedule's value times its scale, so warm-up and cosine shape both. `MuonAdamW` is one
``torch.optim.Optimizer`` over both parts (one state, one ``state_dict``), so the inner trainer
persists and rewinds Muon's momentum buffers exactly as it does AdamW's moments.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fl_geo.inner.choices import ADJUST_LR, OPTIMIZERS

if TYPE_CHECKING:
    from fl_geo.inner.training import InnerConfig

__all__ = ["ADJUST_LR", "LR_SCALE", "OPTIMIZERS", "MuonAdamW", "hidden_matrices", "muon_optimizer", "output_head"]

# A param group's learning rate is the schedule's value times this (1 when absent).
LR_SCALE = "lr_scale"
_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def output_head(model: nn.Module) -> nn.Module | None:
    """The module the model names as its output layer: ``get_output_embeddings()`` of the model or
    of the model it wraps (`fl_geo.inner.hf.CausalLM` keeps it as ``wrapped``); None without one."""
    for owner in (model, model.__dict__.get("wrapped")):
        getter = getattr(owner, "get_output_embeddings", None)
        if callable(getter):
            head = getter()
            if isinstance(head, nn.Module):
                return head
    return None


def hidden_matrices(model: nn.Module) -> list[str]:
    """Names (``named_parameters`` order) of the parameters Muon trains; see the module docstring.

    2-D, not an embedding module's, not the output head's (``get_output_embeddings()``, else the
    last 2-D parameter registered). By tensor identity, so tied tensors are judged once.
    """
    excluded: set[int] = set()
    for module in model.modules():
        if isinstance(module, _EMBEDDINGS):
            excluded.update(id(p) for p in module.parameters())
    head = output_head(model)
    if head is not None:
        excluded.update(id(p) for p in head.parameters())
    else:
        matrices = [p for _, p in model.named_parameters(remove_duplicate=False) if p.ndim == 2]
        if matrices:
            excluded.add(id(matrices[-1]))
    return [name for name, p in model.named_parameters() if p.ndim == 2 and id(p) not in excluded]


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``muon_groups`` and ``torch.optim.AdamW`` over ``adamw_groups``, as one optimizer.

    Parameters
    ----------
    muon_groups, adamw_groups : list of dict
        Param groups (``{"params": [...], ...}``) of each part; either may be empty, not both.
        A Muon group's tensors must be 2-D.
    muon : dict
        ``torch.optim.Muon`` keyword arguments (lr, momentum, nesterov, ns_steps, weight_decay,
        adjust_lr_fn).
    adamw : dict
        ``torch.optim.AdamW`` keyword arguments (lr, betas, eps, weight_decay).

    The two torch optimizers do the arithmetic; this object owns their groups (Muon's first) and one
    state mapping shared with both, so ``param_groups``, ``state``, ``state_dict`` and
    ``load_state_dict`` cover every parameter, and a learning rate set on a group reaches the
    optimizer that steps it. ``matrix_params`` lists Muon's tensors (the state kind of each
    parameter: ``momentum_buffer`` for those, AdamW's ``exp_avg``, ``exp_avg_sq``, ``step`` else).
    """

    def __init__(self, muon_groups: list[dict[str, Any]], adamw_groups: list[dict[str, Any]], *,
                 muon: dict[str, Any], adamw: dict[str, Any]) -> None:
        muon_groups = [g for g in muon_groups if g["params"]]
        adamw_groups = [g for g in adamw_groups if g["params"]]
        self.muon = torch.optim.Muon(muon_groups, **muon) if muon_groups else None
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw) if adamw_groups else None
        parts = [opt for opt in (self.muon, self.adamw) if opt is not None]
        super().__init__([g for opt in parts for g in opt.param_groups], {})
        self._link()

    @property
    def matrix_params(self) -> list[torch.Tensor]:
        return [] if self.muon is None else [p for g in self.muon.param_groups for p in g["params"]]

    def _link(self) -> None:
        """Hand each part its slice of this optimizer's groups and this optimizer's state (again
        after ``load_state_dict``, which replaces both)."""
        n = 0 if self.muon is None else len(self.muon.param_groups)
        if self.muon is not None:
            self.muon.param_groups, self.muon.state = self.param_groups[:n], self.state
        if self.adamw is not None:
            self.adamw.param_groups, self.adamw.state = self.param_groups[n:], self.state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "muon" in self.__dict__:  # load_state_dict, not unpickling before the parts exist
            self._link()

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in (self.muon, self.adamw):
            if opt is not None:
                opt.step()
        return loss


def muon_optimizer(model: nn.Module, cfg: InnerConfig, matrices: Iterable[str] | None = None) -> MuonAdamW:
    """fl-geo's inner optimizer for ``client.optimizer: muon``: Muon on ``matrices`` (default
    `hidden_matrices`) with the ``client.muon_*`` settings, AdamW on every other parameter with the
    AdamW settings and `default_optimizer`'s decay rule (2-D and larger decay, the rest not).

    Muon's lr is ``cfg.muon_lr`` at the schedule's peak (its group's `LR_SCALE` is
    ``muon_lr / lr``). Muon's weight decay is torch's: θ ← θ·(1 − lr·muon_weight_decay) each step,
    with the scheduled (not shape-adjusted) lr.
    """
    named = list(model.named_parameters())
    wanted = set(hidden_matrices(model) if matrices is None else matrices)
    unknown = wanted - {name for name, _ in named}
    if unknown:
        raise ValueError(f"Muon matrices {sorted(unknown)[:3]} are not parameters of the model")
    bad = [name for name, p in named if name in wanted and p.ndim != 2]
    if bad:
        raise ValueError(f"Muon trains 2-D parameters only; {bad[0]} is not 2-D")
    start = cfg.lr if cfg.warmup_steps == 0 else cfg.lr / cfg.warmup_steps  # lr_at(0); the loop sets it anyway
    scale = cfg.muon_lr / cfg.lr
    muon_params = [p for name, p in named if name in wanted]
    rest = [(name, p) for name, p in named if name not in wanted]
    return MuonAdamW(
        [{"params": muon_params, LR_SCALE: scale}],
        [{"params": [p for _, p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0}],
        muon={"lr": start * scale, "momentum": cfg.muon_momentum, "nesterov": cfg.muon_nesterov,
              "ns_steps": cfg.muon_ns_steps, "weight_decay": cfg.muon_weight_decay,
              "adjust_lr_fn": cfg.muon_adjust_lr},
        adamw={"lr": start, "betas": tuple(cfg.betas), "eps": cfg.eps},
    )
