"""Replicas: one endpoint over several copies of a model, each node holding the whole
model. A router's pool of member engines (``pool.py``, its sans-IO choice in
``routing.py``) and the replica wire between a router and the nodes that serve it
(``protocol``, ``service``, ``remote``); and prefill/decode disaggregation: its nodes
(``handoffs``) and the router's engine (``disagg``)."""
