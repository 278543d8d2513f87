"""Time: the wall and virtual clocks, the scenario model (WAN links, accelerator speeds, failures)
and the placement search over it.

Import rule (tested): the standard library, torch, ``fl_geo.core``, ``fl_geo.timing``,
``fl_geo.errors`` and ``fl_geo.paths``; no Flower, gRPC or config schema. Scenario files are read
with omegaconf here (their schema is this package's dataclasses), nowhere below.
"""
