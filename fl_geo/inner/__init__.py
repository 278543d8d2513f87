"""The inner loop on a site: the built-in decoder, the inner trainer (AdamW, schedule, bf16
autocast, time budget), device choice and the torch.distributed data-parallel job across a site's
devices. No Flower: a ClientApp (``fl_geo.clients``) wraps it.
"""
