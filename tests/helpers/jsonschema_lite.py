"""A small JSON Schema validator for the schemas we publish (``mlxctl/schemas.py``): the
keywords they use (type, properties, required, additionalProperties: false, items, enum,
const, anyOf) and nothing else, so that a test needs no ``jsonschema`` package."""

from __future__ import annotations

from typing import Any

KNOWN = {"$schema", "$id", "title", "type", "properties", "required",
         "additionalProperties", "items", "enum", "const", "anyOf"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def errors(doc: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """What in ``doc`` breaks ``schema``, each naming its place (``$.workers[0].pid``)."""
    unknown = set(schema) - KNOWN
    assert not unknown, f"{where}: the validator does not know {sorted(unknown)}"
    found: list[str] = []
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(is_a(doc, k) for k in kinds):
            return [f"{where}: {type(doc).__name__} {doc!r:.60} is not {'/'.join(kinds)}"]
    if "const" in schema and doc != schema["const"]:
        found.append(f"{where}: {doc!r} is not {schema['const']!r}")
    if "enum" in schema and doc not in schema["enum"]:
        found.append(f"{where}: {doc!r} is not one of {schema['enum']}")
    if "anyOf" in schema and all(errors(doc, s, where) for s in schema["anyOf"]):
        found.append(f"{where}: {doc!r:.60} matches none of anyOf")
    if isinstance(doc, dict):
        props = schema.get("properties", {})
        found += [f"{where}: '{k}' is missing" for k in schema.get("required", ())
                  if k not in doc]
        if schema.get("additionalProperties") is False:
            found += [f"{where}: '{k}' is not allowed" for k in doc if k not in props]
        for key, sub in props.items():
            if key in doc:
                found += errors(doc[key], sub, f"{where}.{key}")
    if isinstance(doc, list) and "items" in schema:
        for i, item in enumerate(doc):
            found += errors(item, schema["items"], f"{where}[{i}]")
    return found


def is_a(doc: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(doc, int) and not isinstance(doc, bool)
    if kind == "number":
        return isinstance(doc, int | float) and not isinstance(doc, bool)
    return isinstance(doc, TYPES[kind]) and not (kind != "boolean" and isinstance(doc, bool))
