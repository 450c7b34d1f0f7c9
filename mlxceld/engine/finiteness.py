"""Whether a JSON schema admits a finite value: a schema that only refers back to itself
(``{"$ref": "#"}``, two ``$defs`` that name each other, a required property whose schema is
the whole schema again) compiles in llguidance, but no finite JSON matches it: the mask
then allows nothing but the end of the sequence (an empty answer with finish_reason
"stop"), or one object inside another until max_tokens. ``endless`` finds such a schema
before it reaches an engine, so that the API refuses it naming its field.

A least fixpoint over the schema's subschemas, pure, no IO: a subschema is *finite* when
some finite value can match it, judged from what it consults: its ``$ref`` (a pointer into
the same document), ``allOf`` (every one), ``anyOf`` and ``oneOf`` (any one), and, where
its ``type`` says an object or an array must be produced, the schemas of its ``required``
properties and of its first ``minItems`` items. Everything else (a scalar type, ``const``,
``enum``, no ``type`` at all, a ``$ref`` it cannot resolve, a keyword it does not read)
counts as finite, and so does ``false``: only a loop of references makes a schema endless
here, the judgement only ever errs towards letting a schema through, and what it lets
through is llguidance's to check, as before. A worklist keeps it linear in the
schema's size (at most ``MAX_CONSTRAINT_BYTES`` of it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

Schema = Any  # a JSON schema: a dict, a bool, or (malformed) anything JSON holds
CYCLE_REFS_SHOWN = 3  # the refs of the endless cycle a refusal names


def endless(root: Schema) -> str | None:
    """Why ``root`` admits no finite value, naming the ``$ref``s that loop and what to do
    (None: it admits one, or this cannot tell)."""
    if not isinstance(root, dict):
        return None
    nodes, paths, parents = _reachable(root)
    finite: set[int] = set()
    work = deque(nodes.values())
    while work:
        node = work.popleft()
        if id(node) in finite or not _finite(node, root, finite):
            continue
        finite.add(id(node))
        work.extend(nodes[p] for p in parents.get(id(node), ()))
    if id(root) in finite:
        return None
    loops = [f"'$ref' {node['$ref']!r} at {paths[key]}" for key, node in nodes.items()
             if key not in finite and isinstance(node.get("$ref"), str)]
    shown = ", ".join(loops[:CYCLE_REFS_SHOWN]) + (", ..." if len(loops) > CYCLE_REFS_SHOWN
                                                  else "")
    return (f"its references loop with no way out ({shown or 'a cycle'}); give the "
            "recursion an end, such as an optional property or an anyOf branch without it")


def _reachable(root: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[int, str],
                                                dict[int, set[int]]]:
    """Every subschema ``root`` consults (by id), the path it was first reached by, and
    who consults each."""
    nodes: dict[int, dict[str, Any]] = {id(root): root}
    paths = {id(root): "#"}
    parents: dict[int, set[int]] = {}
    work = deque([root])
    while work:
        node = work.popleft()
        for child, step in _consulted(node, root):
            if not isinstance(child, dict):
                continue
            parents.setdefault(id(child), set()).add(id(node))
            if id(child) not in nodes:
                nodes[id(child)] = child
                paths[id(child)] = step if step.startswith("#") else f"{paths[id(node)]}/{step}"
                work.append(child)
    return nodes, paths, parents


def _finite(node: dict[str, Any], root: dict[str, Any], finite: set[int]) -> bool:
    """Whether ``node`` admits a finite value, given the subschemas known ``finite``."""
    def ok(child: Schema) -> bool:  # false, or malformed: llguidance's to judge
        return id(child) in finite if isinstance(child, dict) else True

    if "const" in node or (isinstance(node.get("enum"), list) and node["enum"]):
        return True  # a literal: finite whatever else it says (a conflict is llguidance's)
    ref = _resolve(root, node.get("$ref"))
    if ref is not None and not ok(ref):
        return False
    if not all(ok(s) for s in _listed(node, "allOf")):
        return False
    for key in ("anyOf", "oneOf"):
        branches = _listed(node, key)
        if branches and not any(ok(s) for s in branches):
            return False
    types = node.get("type")
    kinds = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if not kinds:
        return True
    return any(all(ok(s) for s, _ in _produced(node, kind)) for kind in kinds)


def _consulted(node: dict[str, Any], root: dict[str, Any]) -> Iterator[tuple[Schema, str]]:
    """The subschemas ``node``'s finiteness depends on, each with its path (a step from
    ``node``, or a pointer of its own for a ``$ref``'s target)."""
    ref = node.get("$ref")
    target = _resolve(root, ref)
    if target is not None:
        yield target, str(ref)
    for key in ("allOf", "anyOf", "oneOf"):
        for i, sub in enumerate(_listed(node, key)):
            yield sub, f"{key}/{i}"
    types = node.get("type")
    for kind in [types] if isinstance(types, str) else types if isinstance(types, list) else []:
        yield from _produced(node, kind)


def _produced(node: dict[str, Any], kind: object) -> list[tuple[Schema, str]]:
    """What a value of type ``kind`` under ``node`` must hold: the schemas of its required
    properties (an object) or of its first ``minItems`` items (an array)."""
    if kind == "object":
        props = node.get("properties")
        props = props if isinstance(props, dict) else {}
        extra = node.get("additionalProperties", True)
        required = node.get("required")
        return [(props[name], f"properties/{_escape(name)}") if name in props
                else (extra, "additionalProperties")
                for name in (required if isinstance(required, list) else [])
                if isinstance(name, str)]
    if kind == "array":
        least = node.get("minItems")
        if not isinstance(least, int) or isinstance(least, bool) or least < 1:
            return []
        items = node.get("items", True)
        prefix = node.get("prefixItems")
        if isinstance(items, list):  # the tuple form of drafts before 2020-12
            prefix, items = items, node.get("additionalItems", True)
        prefix = prefix if isinstance(prefix, list) else []
        first = [(s, f"prefixItems/{i}") for i, s in enumerate(prefix[:least])]
        return first + ([(items, "items")] if least > len(prefix) else [])
    return []


def _listed(node: dict[str, Any], key: str) -> list[Schema]:
    value = node.get(key)
    return value if isinstance(value, list) else []


def _resolve(root: dict[str, Any], ref: object) -> Schema | None:
    """The subschema a ``$ref`` names by a JSON pointer into this document (``#``,
    ``#/$defs/a``); None for any other reference, or one that names nothing."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    at: Any = root
    for raw in ref[2:].split("/") if ref != "#" else []:
        step = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(at, dict) and step in at:
            at = at[step]
        elif isinstance(at, list) and step.isdigit() and int(step) < len(at):
            at = at[int(step)]
        else:
            return None
    return at


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
