"""Flower ClientApps of fl-geo (installed as ``fl_geo.clients``).

The public API wraps any torch model as a datacenter ClientApp::

    from fl_geo.clients import make_client_app
    app = make_client_app(model_fn, batches_fn, eval_batches_fn=eval_batches_fn)

A Hugging Face causal LM goes through ``causal_lm`` first (``make_client_app(causal_lm(model_fn),
...)``: logits out, a tied head held once; docs/models.md).
(docs/client_api.md). Imports are lazy so that ``fl_geo.clients.persist`` and friends stay
importable without building a ClientApp.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DatacenterClient", "Site", "as_batch_source", "causal_lm", "make_client_app"]


def __getattr__(name: str) -> Any:
    if name in ("DatacenterClient", "make_client_app"):
        from fl_geo.clients import api

        return getattr(api, name)
    if name == "causal_lm":
        from fl_geo.inner.hf import causal_lm

        return causal_lm
    if name in ("Site", "as_batch_source"):
        from fl_geo.clients import site

        return getattr(site, name)
    raise AttributeError(f"module 'fl_geo.clients' has no attribute {name!r}")
