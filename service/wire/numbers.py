"""JSON number lists: only numbers where numbers belong.

torch (and numpy) take ``true``/``false`` for 1/0 in a list of numbers, so a JSON tensor such as
``[[[[true, false]]]]`` would be computed as 1.0, 0.0. ``check_numbers`` refuses any leaf that is
not an int or a float (booleans, strings, null, objects) with the path of the first one, before the
list is converted. The common case costs one ``set(map(type, row))`` per innermost list.
"""

from __future__ import annotations

from typing import Any

from service.errors import BadRequest
from service.wire.tensors import MAX_DIMS

_NUMBERS = frozenset({int, float})
_LISTS = frozenset({list})


def check_numbers(data: list, name: str) -> None:
    """400 unless ``data`` is a list whose leaves are all JSON numbers (nested lists of any depth;
    raggedness is left to the converter). The message names the first bad leaf, e.g.
    ``q[0][0][1]``."""
    _check(data, name, 1)


def _check(row: list, path: str, depth: int) -> None:
    if not row:
        return
    if depth > MAX_DIMS:
        raise BadRequest(f"{path}: nested lists deeper than {MAX_DIMS} dims")
    types = set(map(type, row))
    if types <= _NUMBERS:
        return
    if types <= _LISTS:
        for i, sub in enumerate(row):
            _check(sub, f"{path}[{i}]", depth + 1)
        return
    nested = type(row[0]) is list  # a mixed row: the first element that does not belong
    for i, x in enumerate(row):
        if type(x) in _NUMBERS:
            if nested:
                raise BadRequest(f"{path}[{i}]: a number where a list belongs (the nesting is ragged)")
        elif type(x) is list:
            if not nested:
                raise BadRequest(f"{path}[{i}]: a list where a number belongs (the nesting is ragged)")
        else:
            raise BadRequest(f"{path}[{i}]: {_what(x)} where a number belongs (JSON tensors hold numbers only)")


def _what(x: Any) -> str:
    if isinstance(x, bool):
        return f"the boolean {str(x).lower()}"
    if x is None:
        return "null"
    if isinstance(x, str):
        return f"the string {x[:20]!r}"
    if isinstance(x, list):
        return "a list"
    if isinstance(x, dict):
        return "an object"
    return type(x).__name__
