"""fl-geo: Flower strategies and clients for training language models across datacenters over slow WAN links."""

__version__ = "0.1.0"
