"""Flower ClientApps of fl-geo (installed as ``fl_geo.clients``)."""
