"""The cluster: the cluster TOML (``clusterfile``), pipeline plans (``plan``), the
two-phase stage assignment (``assignment``), this node's cluster secret (``keyring``)
and, on top of them, the coordinator's bring-up (``coordinator``).

Importing this package never imports mlx.
"""
