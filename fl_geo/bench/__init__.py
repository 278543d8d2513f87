"""Benchmarks behind ``fl-geo bench``: the outer step against memory bandwidth and Flower's FedAvg
(``outer``), server overhead per update (``dispatch``, with the no-op ClientApp), the sharded
parameter server (``ps``) and Flower's own loopback message path (``flower-path``). Each prints its
figure next to a baseline measured in the same run.
"""
