"""From YAML and ``--set`` flags to section objects: reading a YAML file, parsing an
override, checking each value against its field's type hint."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path
from typing import Any, Union

import yaml

from raytrain_platform.config.sections import Section, check_field
from raytrain_platform.errors import ConfigError

__all__ = ["read_yaml", "apply_overrides", "add_set_flag", "build_section", "parse_override", "section_dict",
           "set_path"]


def section_dict(section: Any) -> dict:
    """A section's fields as plain data; a nested section (``train.dpo``) as a mapping."""
    return {f.name: section_dict(v) if dataclasses.is_dataclass(v := getattr(section, f.name)) else v
            for f in dataclasses.fields(section)}


def build_section(cls: type[Section] | type[Any], data: Any) -> Any:
    section = cls.SECTION
    check_field(isinstance(data, dict), section, data, "a mapping of keys to values")
    if hasattr(cls, "normalize"):  # a section's shorthand forms, e.g. elastic num_workers
        data = cls.normalize(data)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        check_field(key in fields, f"{section}.{key}", data[key],
               f"no such key; {section} keys are {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            try:
                kwargs[name] = _coerce(f"{section}.{name}", data[name], hints[name])
            except ConfigError as exc:  # a field's own words for what it takes, where it has them
                allowed = getattr(cls, "_ALLOWED", {}).get(name)
                raise (ConfigError(exc.field, exc.value, allowed) if allowed else exc) from None
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{section}.{name}", None, "a value (required)")
    return cls(**kwargs)


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Check `value` against a type hint; ints widen to float, nothing else is guessed."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        allowed = []
        for option in inner:  # the first type that takes the value (int before str: 8 stays 8)
            try:
                return _coerce(path, value, option)
            except ConfigError as exc:
                allowed.append(exc.allowed)
        raise ConfigError(path, value, " or ".join(allowed) + (" or null" if type(None) in args else ""))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a nested section (train.dpo): its own keys, checks
        return build_section(tp, value)
    if tp is bool:
        check_field(isinstance(value, bool), path, value, "true or false")
        return value
    if tp is int:
        check_field(isinstance(value, int) and not isinstance(value, bool), path, value, "an integer")
        return value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        check_field(ok and value == value and abs(value) != float("inf"), path, value, "a finite number")
        return float(value)
    if tp is str:
        check_field(isinstance(value, str), path, value, "a string")
        return value
    if origin is list:
        check_field(isinstance(value, list), path, value, "a list")
        return [_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        check_field(isinstance(value, dict), path, value, "a mapping")
        return dict(value)
    raise TypeError(f"unsupported config type {tp} for {path}")  # a bug in this module


def set_path(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    check_field(len(parts) >= 2 and all(parts), dotted, value, "a dotted path like 'train.lr'")
    node = data
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or a section left empty in the YAML (`parallel:`)
            node[part] = {}
        nxt = node[part]
        check_field(isinstance(nxt, dict), dotted, value, f"a path into a mapping ('{part}' is not one)")
        node = nxt
    node[parts[-1]] = value


def add_set_flag(parser: argparse.ArgumentParser,
                 help: str = "override a config field, e.g. --set train.lr=3e-4 (repeatable)") -> None:
    """The ``--set KEY=VALUE`` flag of every command that takes a config (its values, in
    ``args.overrides``, go to `load_config` and `parse_override`)."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.lr=3e-4"`` -> ``("train.lr", 0.0003)``; the value is read as YAML, and
    text that is not YAML is taken as it is (``data.glob=**/*.txt``: YAML would read
    ``*`` as an alias); the field's type then decides whether it fits.

    >>> parse_override("data.glob=**/*.txt"), parse_override("data.feature_columns=[a, b]")
    (('data.glob', '**/*.txt'), ('data.feature_columns', ['a', 'b']))
    """
    key, sep, raw = text.partition("=")
    check_field(bool(sep) and bool(key.strip()), "--set", text, "KEY=VALUE, e.g. train.lr=3e-4")
    try:
        value = yaml.load(raw, Loader=_StrictLoader) if raw.strip() else None
    except yaml.YAMLError:
        value = raw.strip()
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
        value = float(value)  # YAML 1.1 reads "3e-4" as a string; people mean the number
    return key.strip(), value


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    for text in overrides or []:
        key, value = parse_override(text)
        set_path(data, key, value)
    return data


class _StrictLoader(yaml.SafeLoader):
    """``safe_load``, and a key given twice in one mapping is an error (YAML itself
    keeps the last, silently dropping the first: a whole section, say)."""


def _unique_keys(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, yaml.Mark] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.setdefault(key, key_node.start_mark)
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        if first is not key_node.start_mark:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice (first at line {first.line + 1})", key_node.start_mark)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys)


def read_yaml(path: Path, what: str = "config") -> Any:
    """A YAML file's data (``safe_load``: tags that would build Python objects are
    refused), or one `ConfigError` naming `what` and the file: missing, unreadable, not
    UTF-8, or not YAML (with the line)."""
    if not path.is_file():
        raise ConfigError(what, str(path), "an existing YAML file")
    try:
        return yaml.load(path.read_bytes().decode("utf-8"), Loader=_StrictLoader)
    except OSError as exc:
        raise ConfigError(what, str(path), f"a readable YAML file ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(what, str(path), f"a UTF-8 YAML file (byte {exc.start} is not UTF-8)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or "").split())
        detail = f"{where}: {problem}" if problem else where
        raise ConfigError(what, str(path), f"valid YAML (parse error{detail})") from None
