"""The router's ``/metrics`` with an API key: needed by default, as on every route but
``/health``; ``metrics_open`` (``[serve] metrics_require_key = false``) opens ``/metrics``
alone."""

from __future__ import annotations

import asyncio

from helpers.api import KEY, http_client, make_app


def statuses(**options: object) -> dict[str, int]:
    async def main() -> dict[str, int]:
        async with http_client(make_app(api_key=KEY, **options)) as client:
            return {path: (await client.get(path)).status_code
                    for path in ("/metrics", "/v1/models", "/health")}

    return asyncio.run(main())


def test_metrics_need_the_key_unless_opened() -> None:
    assert statuses() == {"/metrics": 401, "/v1/models": 401, "/health": 200}
    assert statuses(metrics_open=True) == {"/metrics": 200, "/v1/models": 401, "/health": 200}
