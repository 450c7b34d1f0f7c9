"""A request body read whole, but never past a limit: the control API's and the OpenAI
port's (each with its own limit and its own errors)."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request


async def read_bounded(request: Request, limit: int, *, too_large: Exception,
                       went_away: Exception) -> bytes:
    """The whole body; ``too_large`` raised as soon as it is declared or grows past
    ``limit`` bytes (nothing more is read), ``went_away`` if the client left mid-body."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise went_away from None
    return b"".join(chunks)
