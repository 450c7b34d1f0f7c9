"""Pipeline parallelism: the stage protocol, the stage service and the pipeline engine.

A model split by layer range over stage workers on several hosts; the router's
``PipelineEngine`` drives them over MXCL channel 1, worker to worker. Importing
this package does not import mlx.
"""

from mlxceld.pipeline.attaching import StageAddress
from mlxceld.pipeline.engine import PipelineEngine
from mlxceld.pipeline.sequences import StagePlace
from mlxceld.pipeline.stage import StageService

__all__ = ["PipelineEngine", "StageAddress", "StagePlace", "StageService"]
