"""The inner loop on a site: the built-in decoder, Hugging Face causal LMs (``hf.py``; transformers
is an optional extra imported only when such a model is built), the inner trainer (AdamW, or Muon
+ AdamW: ``muon.py``; schedule, bf16 autocast, time budget), device choice and the
torch.distributed data-parallel job across a site's devices. No Flower: a ClientApp
(``fl_geo.clients``) wraps it.
"""
