"""Flower server-side strategies of fl-geo (installed as ``fl_geo.strategies``)."""
