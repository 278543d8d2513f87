"""The maths of every method, framework-free: flat parameter state, weighted sums, outer optimizers,
Di-PS's grace window, EDiT's penalty, Streaming DiLoCo's fragments and schedules, the HALoS server
objects, shard arithmetic, quantisation and checkpoint layout.

Import rule (tested by ``tests/test_layers.py``): modules here import only the standard library,
torch, numpy, other ``fl_geo.core`` modules and the two standard-library-only leaves
``fl_geo.errors`` and ``fl_geo.atomic`` (crash-safe file writes). No Flower, gRPC, omegaconf or config schema, so
every formula is unit-tested on plain tensors and can be reused outside Flower.
"""
