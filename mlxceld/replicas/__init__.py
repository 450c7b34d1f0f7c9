"""Replicas: serving more users than one host can, over several nodes that each hold the
whole model (the replica wire: ``protocol``, ``service``, ``remote``)."""
