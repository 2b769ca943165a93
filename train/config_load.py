"""How a configuration's plain values become its nested frozen dataclasses.

``_read_yaml`` reads a config file's mapping, ``_merge`` lays an overlay file's sections
over it and ``_set`` puts a dotted ``key=value`` override into it; ``_build`` then makes
the dataclass of a mapping, section by section over the fields' defaults, checking each
value against its field's annotation and converting it where lossless (``_coerce``).
Unknown keys and wrong types are ``ConfigError``s naming the key and the valid keys near
it. What the sections are, and ``load_config``, are ``jaxpar.train.config``'s.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import pathlib
import types
import typing
from typing import Any, Literal

from jaxpar.inputs import InputError, read_yaml
from jaxpar.layout import KEYS as LAYOUT_KEYS


class ConfigError(InputError):
    """A bad configuration key or value; the CLI prints it on one line and exits 2."""


def _keys(cls, prefix="") -> list[str]:
    """The dotted keys of ``cls``'s fields; a field read from keys of other sections (its
    metadata's ``keys``: ``Config.layout``'s) counts as those."""
    keys = []
    for field in dataclasses.fields(cls):
        if "keys" in field.metadata:
            keys += list(field.metadata["keys"])
            continue
        hint = _hints(cls)[field.name]
        inner = _dataclass_in(hint)
        keys += _keys(inner, f"{prefix}{field.name}.") if inner else [prefix + field.name]
    return keys


def _dataclass_in(hint, value=None):
    """The dataclass a field holds (also through ``X | None``), or None. Of several
    (``model``: a ``ModelConfig`` or a ``DLRMConfig``), the one whose fields hold the most
    keys of ``value`` (a mistyped key is then reported against the right one), the first
    on a tie."""
    candidates = [c for c in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(c)]
    if not candidates:
        return None
    keys = set(value) if isinstance(value, dict) else set()
    return max(candidates, key=lambda c: len(keys & {f.name for f in dataclasses.fields(c)}))


def _coerce(value: Any, hint, key: str):
    """Checks ``value`` against the annotation ``hint`` and converts it where lossless."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors, literals = [], []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                if typing.get_origin(arg) is Literal:
                    literals += typing.get_args(arg)
                else:
                    errors.append(str(e))
        if errors and literals:  # mesh=foo: a mapping, or "auto"
            raise ConfigError(f"{errors[0]}, or one of {literals}")
        raise ConfigError(errors[0] if errors else f"{key}={value!r} must be one of {literals}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} must be one of {list(args)}")
        return value
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):  # built already (Config.layout, from its keys)
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r} must be a mapping of {hint.__name__} fields")
        return _build(hint, value, key + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} must be a list")
        return tuple(_coerce(v, args[0], key) for v in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}={value!r} must be an integer")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r} must be a string")
        return value
    raise ConfigError(f"{key}: unsupported type {hint}")


def _near(key: str, valid: list[str]) -> list[str]:
    """The keys of ``valid`` a mistyped ``key`` most likely meant, at most three: close
    spellings of it (``stpes``: ``steps``; difflib's ratio 0.75 or more, not the loose
    0.6 that offers ``mesh.axis_types`` for ``stpes``), then keys whose last part it
    names exactly (``lr``: ``optimizer.lr``)."""
    leaf = key.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(key, valid, n=3, cutoff=0.75)
    near += [k for k in valid if k.rsplit(".", 1)[-1] == leaf and k not in near]
    return near[:3]


@functools.cache
def _hints(cls) -> dict:
    """``cls``'s field annotations, evaluated once per class."""
    return typing.get_type_hints(cls)


def _build(cls, values: dict, prefix: str = ""):
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for name in values:
        if name not in names:
            key = prefix + name
            valid = [k for k in LAYOUT_KEYS.values() if prefix and k.startswith(prefix)] + _keys(cls, prefix)
            near = _near(key, valid) or valid[:8]
            raise ConfigError(f"unknown config key {key!r}; valid keys near it: {', '.join(near)}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        inner = _dataclass_in(hint, value)
        if inner is not None and isinstance(value, dict):
            default = getattr(cls(), name) if _has_default(cls, name) else None
            default = default if isinstance(default, inner) else None
            merged = {**(dataclasses.asdict(default) if default is not None else {}), **value}
            kwargs[name] = _build(inner, merged, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, hint, prefix + name)
    try:
        return cls(**kwargs)
    except ValueError as e:  # a dataclass's own __post_init__ validation
        raise ConfigError(str(e)) from None


def _has_default(cls, name) -> bool:
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING


def _set(tree: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = tree.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config key {part!r} in {dotted!r} is not a section")
        tree = node
    tree[leaf] = value


def _read_yaml(path: pathlib.Path) -> dict:
    values = read_yaml(path, named=f"config file {str(path)!r}", error=ConfigError) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys to values")
    return values


def _merge(values: dict, overlay: dict) -> None:
    """``overlay``'s keys over ``values``, section by section."""
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(values.get(key), dict):
            _merge(values[key], value)
        elif key == "model" and isinstance(value, dict) and isinstance(values.get(key), str):
            values[key] = {"preset": values[key], **value}
        else:
            values[key] = value
