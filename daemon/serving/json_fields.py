"""The client error of the request parsers and the readers of typed JSON fields.

:class:`ApiError` is every rejection of a request body: a one-line ``message`` naming the
field and what it allows, the offending ``param``, the HTTP ``status`` (400 unless stated) and
OpenAI's string ``code`` where it has one. The readers here (``_int``, ``_float``, ``_bool``)
take a field of a decoded body, ``default`` when it is absent or null, and raise
:class:`ApiError` when it has the wrong type or lies outside its range. An integral number
(``5.0``) is an integer, as pydantic's lax mode takes it for vLLM's ``int`` fields; a boolean
is never a number.

Error messages quote the client's language, JSON, never Python's: ``true``, ``null``,
``"text"``, ``NaN`` (:func:`json_value`), with the JSON type where it helps
(:func:`json_typed`, :func:`typed_value`: ``string "yes"``, ``boolean true``). Text the
engine receives must be encodable as UTF-8 (:func:`check_utf8`: JSON allows lone surrogates).
"""

from __future__ import annotations

import json
import math


class ApiError(Exception):
    """A client error: ``message`` (one line), ``param`` (offending field), HTTP ``status``, and
    the body's ``code`` (OpenAI's string code, e.g. ``"model_not_found"``; None: the status)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, headers: dict | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.headers = message, param, status, headers or {}
        self.code = code


def json_type(v) -> str:
    """The JSON name of a decoded value's type (``null``, ``boolean``, ``number``, ``string``,
    ``array``, ``object``), for error messages that speak the client's language."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _int(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None):
    """Field ``name`` as an int in [lo, hi], or ``default`` when absent or null.

    An integral JSON number (``5.0``) is taken as that integer, as pydantic's lax mode does
    for vLLM's ``int`` fields; ``5.5``, booleans and strings raise :class:`ApiError`."""
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(f"{name} must be an integer, got {typed_value(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(f"{name} must be an integer in [{lo if lo is not None else '-inf'}, "
                       f"{hi if hi is not None else 'inf'}], got {json_value(v)}", name)
    return v


def finite_number(v) -> bool:
    """``v`` is a JSON number other than NaN / ±Infinity (never a boolean). An integer of any
    size counts (``1e400`` written as 401 digits decodes to an int): it is compared with a
    range exactly, where ``math.isfinite`` would raise OverflowError on converting it."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    return isinstance(v, int) or math.isfinite(v)


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    """Field ``name`` as a float in [lo, hi] (``(lo, hi]`` with ``lo_open``), or ``default``
    when absent or null; NaN, ±Infinity, booleans, strings and out-of-range numbers (an integer
    too large for a float included) raise :class:`ApiError`."""
    v = body.get(name, default)
    if v is None:
        return default
    if not finite_number(v):
        raise ApiError(f"{name} must be a finite number, got {json_value(v)}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise ApiError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {json_value(v)}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(f"{name} must be a boolean, got {json_value(v)}", name)
    return v


def json_typed(v) -> str:
    """A value for "got ..." in an error message: its JSON type, and for a scalar the value as
    the client wrote it (``string "yes"``, ``boolean true``, ``null``; ``array`` / ``object`` alone)."""
    t = json_type(v)
    return t if t in ("null", "array", "object") else f"{t} {json_value(v)}"


class OverflowFloat(float):
    """A JSON number past float64's range (``1e400``): infinity to every check, with the
    ``literal`` the client wrote, which :func:`json_value` quotes."""

    literal: str


def parse_float(text: str) -> float:
    """``json.loads``' ``parse_float`` for request bodies: ``float(text)``, an
    :class:`OverflowFloat` keeping ``text`` where it overflows."""
    f = float(text)
    if math.isinf(f):
        f = OverflowFloat(f)
        f.literal = text
    return f


def json_value(v, limit: int = 40) -> str:
    """A decoded request value as the client wrote it, in JSON (``true``, ``null``, ``"text"``,
    ``NaN``, ``1e400``), cut to ``limit`` characters with ``...``: error messages quote the
    client's language, not Python's (``True``, ``None``, ``nan``, ``inf``)."""
    try:
        r = v.literal if isinstance(v, OverflowFloat) else json.dumps(v, ensure_ascii=False)
    except (TypeError, ValueError):
        r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def typed_value(v) -> str:
    """``v``'s JSON type and value for an error message (``boolean true``, ``string "ten"``), or
    ``null`` alone."""
    return "null" if v is None else f"{json_type(v)} {json_value(v)}"


def check_utf8(text: str, field: str) -> str:
    """``text`` if it is encodable as UTF-8 (JSON allows lone surrogates like ``"\\ud800"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(f"{field} is not valid Unicode text ({e.reason} at position {e.start})", field) from None
    return text

