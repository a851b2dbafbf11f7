"""OpenAI's published API description (the shared copy of openai/openai-openapi's
``openapi.json``) as JSON Schema validators, for tests/test_serve_openai_fields.py.

The document is OpenAPI 3.1 with some OpenAPI 3.0 ``nullable: true`` left in: those
become a union with ``null`` (``type: [T, "null"]``, or ``anyOf`` with ``{"type":
"null"}`` where there is no ``type``). ``$ref``s resolve against the whole document
(a `referencing` registry), validated with JSON Schema 2020-12 (OpenAPI 3.1's dialect).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

ROOT = Path(__file__).resolve().parents[1]
# OpenAI's published API description (openai/openai-openapi, MIT), copied as the project shared it.
DOCUMENT = ROOT / "tests" / "data" / "openai-openapi.json.gz"
_URI = "urn:openai-openapi"


def _with_null(node: Any) -> Any:
    """The document with every ``nullable: true`` turned into a union with null."""
    if isinstance(node, list):
        return [_with_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _with_null(value) for key, value in node.items() if key != "nullable"}
    if node.get("nullable") is True:
        kind = out.get("type")
        if isinstance(kind, str):
            out["type"] = [kind, "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        elif isinstance(kind, list):
            out["type"] = [*kind, "null"]
        else:
            out = {"anyOf": [out, {"type": "null"}]}
    return out


class OpenAISchemas:
    """``validate(name, obj)`` -> the list of errors (``path: message``) of `obj`
    against ``#/components/schemas/NAME``."""

    def __init__(self, path: Path = DOCUMENT):
        document = _with_null(json.loads(gzip.decompress(path.read_bytes())))
        self.registry = Registry().with_resource(_URI, Resource.from_contents(document, default_specification=DRAFT202012))
        self.names = set(document["components"]["schemas"])

    def validate(self, name: str, obj: Any) -> list[str]:
        assert name in self.names, name
        validator = jsonschema.Draft202012Validator({"$ref": f"{_URI}#/components/schemas/{name}"},
                                                    registry=self.registry)
        return [f"{'/'.join(map(str, e.absolute_path)) or '.'}: {e.message[:160]}"
                for e in _leaves(validator.iter_errors(obj))]


def _leaves(errors: Any) -> Any:
    """The errors inside a union (``anyOf``: a value or null): those of its non-null
    branches, so a message names the field at fault, not the whole object."""
    for error in errors:
        inner = [e for e in error.context or () if "is not of type 'null'" not in e.message]
        yield from _leaves(inner) if inner else [error]
