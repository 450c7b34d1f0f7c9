"""Configuration: everything the daemon is told, read and checked once at the edge.

``daemon`` is the config file's ``[daemon]``, ``[supervisor]`` and ``[workers]``
tables with the flags that override them (one typed ``Config``); ``serve`` its
``[serve]`` table; ``cluster`` and ``peers`` the cluster name, discovery mode
and static peers; ``stage_ports`` the stage listeners' port range; ``secrets``
where the cluster secret comes from; ``names`` the rules for node ids and
cluster names that the cluster TOML shares. Every room may import this one; it
imports none above it (see ARCHITECTURE.md).
"""
