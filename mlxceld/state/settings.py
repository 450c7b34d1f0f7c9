"""The ``settings`` table: what was changed at run time and must survive a restart."""

from __future__ import annotations

import json
import time

import sqlite_utils
from sqlite_utils.db import NotFoundError

from mlxceld.types import JSON


class Settings:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self._table = db.table("settings")

    def get(self, key: str) -> JSON | None:
        try:
            value: JSON = json.loads(self._table.get(key)["value"])
        except NotFoundError:
            return None
        return value

    def put(self, key: str, value: JSON) -> None:
        self._table.upsert({"key": key, "value": json.dumps(value, sort_keys=True),
                            "updated_at": time.time()}, pk="key")

    def delete(self, key: str) -> None:
        self._table.delete_where("key = ?", [key])
