"""The cluster TOML (mlxcel-cluster.toml(5)): its typed model (``model``), its fields
read one at a time (``fields``), the rules across nodes and against the checkpoint
(``rules``), loading, checking and writing it (``load``), and this daemon's place in
it with the worker it runs there (``placement``)."""
