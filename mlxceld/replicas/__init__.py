"""Replicas: one endpoint over several copies of a model. A router's pool of member
engines (``pool.py``, its sans-IO choice in ``routing.py``) and the wire between a
router and the nodes that serve it."""
