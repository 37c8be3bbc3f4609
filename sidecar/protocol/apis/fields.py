"""Checks of single JSON fields that every API module's body checks share (pure).

    is_int(value)                    an integer that is not a JSON boolean
    check_bool / check_int_or_null   raise ``InvalidRequest`` naming the field and its type

Messages name the field and the JSON type only (``jsonutil.type_name``), never a value (a value
may quote the prompt).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypeGuard

from sidecar.errors import InvalidRequest
from sidecar.jsonutil import type_name


def is_int(value: object) -> TypeGuard[int]:
    # JSON true/false parse to bool, a subclass of int in Python.
    return isinstance(value, int) and not isinstance(value, bool)


def is_token_ids(value: list[Any]) -> bool:
    return all(is_int(item) for item in value)


def check_bool(body: Mapping[str, Any], key: str, where: str = "") -> None:
    """``body[key]`` is a boolean or null (or absent)."""
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"'{where}{key}' must be a boolean, got {type_name(value)}")


def check_int_or_null(body: Mapping[str, Any], keys: Iterable[str], where: str = "") -> None:
    """Each of ``keys`` in ``body`` is an integer or null (or absent)."""
    for key in keys:
        value = body.get(key)
        if value is not None and not is_int(value):
            raise InvalidRequest(
                f"'{where}{key}' must be an integer or null, got {type_name(value)}")


def check_string_or_null(body: Mapping[str, Any], key: str) -> None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidRequest(f"'{key}' must be a string or null, got {type_name(value)}")


def check_object_list(body: Mapping[str, Any], key: str) -> None:
    """``body[key]`` is a non-empty array of objects."""
    items = body.get(key)
    if not isinstance(items, list) or not items or not all(isinstance(i, dict) for i in items):
        raise InvalidRequest(f"'{key}' must be a non-empty array of objects")
