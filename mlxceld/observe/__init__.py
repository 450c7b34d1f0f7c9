"""What a daemon shows Prometheus (``[daemon] metrics_listen``): its own metrics and its
workers', each scrape read afresh (``server.py``), every name in ``catalog.py``."""

from mlxceld.observe.catalog import FAMILIES, Family
from mlxceld.observe.server import MetricsServer, metrics_app, scrape

__all__ = ["FAMILIES", "Family", "MetricsServer", "metrics_app", "scrape"]
