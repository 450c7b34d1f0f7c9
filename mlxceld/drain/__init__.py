"""Draining a node (`mlxctl drain`, `mlxctl undrain`): the persisted state, and the
router told which nodes its requests need are draining (``service``)."""

from mlxceld.drain.service import PUSH_EVERY_S, DrainService, known_node, refuse_stage_host

__all__ = ["PUSH_EVERY_S", "DrainService", "known_node", "refuse_stage_host"]
