"""The asyncio shell over wire/: for now, the security log's rate limiter."""

from mlxceld.net.securitylog import SecurityClass, SecurityLog, Verdict

__all__ = ["SecurityClass", "SecurityLog", "Verdict"]
