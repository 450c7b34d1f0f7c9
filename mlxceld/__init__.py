"""mlxceld: distributed LLM inference for a handful of machines, run as a service."""

__version__ = "0.1.0"
