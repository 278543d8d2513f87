"""Probe of Flower's deployment message path: one array out, the same array (XOR 1) back."""
