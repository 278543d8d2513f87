"""The Flower glue both sides share: the wire codec (tensors <-> ``ArrayRecord``), the typed message
protocol, the dispatcher that drives a Flower ``Grid``, the in-process grid, evaluation, the
builders that turn a config into a model and data, metrics and progress output.

Import rule: may use Flower, ``fl_geo.core``, ``fl_geo.timing``, ``fl_geo.inner`` and
``fl_geo.data``; never the strategies, the clients, or the deployment and benchmark packages.
The optional ``safetensors`` package is imported only where the final model is exported
(``session.py``), and its absence is not an error.
"""
