"""What a model request's body must be before any route reads it: UTF-8 JSON text of one
object, bounded. Parse, then bound: the checks run on what the parser builds, never on
raw bytes (``json.loads`` also reads UTF-16 and UTF-32, where a byte scan is blind).

``parse_body(body)`` is called by the request guard (``serving.guard``) for every model
request, on the server's event loop or, for a large body, in a thread; it does not block
on anything: one decode, one parse by Python's own parser, one iterative walk of what it
built (tens of milliseconds for the largest body SageMaker accepts). In order:

1. encoding: the body is decoded as ``json.loads`` decodes bytes (``json.detect_encoding``:
   a BOM, or the zero bytes of UTF-16/UTF-32 text). Only UTF-8, with or without its BOM,
   is accepted (RFC 8259 section 8.1); a UTF-16 or UTF-32 body is refused by name rather
   than converted, so every later reader of the body (our routes, the SageMaker standards
   library) parses exactly the text checked here. The decoding is strict: bytes that are
   not UTF-8 (encoded surrogates included, which ``json.loads`` lets through) are refused;
2. the parse, by Python's parser: ``NaN`` and ``Infinity`` are refused (not JSON); its
   recursion ends past about a thousand levels of nesting, its ``RecursionError`` caught;
   an integer of more than 4,300 digits, which it refuses, is a number too long;
3. the value is one JSON object;
4. one walk of it, without recursion: nesting at most ``MAX_JSON_DEPTH`` deep (nothing
   deeper reaches vLLM, whose engine pickles a request's parameters recursively on the way
   to its workers: a 900-deep list killed the engine); integers within signed 64 bits (the
   MessagePack transport to the engine carries no more: a larger ``top_k`` was a 500; one
   of more than ``MAX_NUMBER_DIGITS`` digits is named so); floats finite (``1e999``);
   and, when the text holds a surrogate escape at all, no string or key with a lone UTF-16
   surrogate (a ``\\ud800`` escape without its pair): not text, and no tokenizer takes it.

Every refusal is a ``BodyError`` whose message the guard answers with (400).
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_JSON_DEPTH = 64  # nesting of arrays and objects; OpenAI bodies need < 20
MAX_NUMBER_DIGITS = 64  # digits in one JSON number (a 64-bit seed has 20)
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
UTF8 = ("utf-8", "utf-8-sig")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800 .. \udfff in the JSON text
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # what is left of one after parsing
DEEP = f"the body nests arrays and objects more than {MAX_JSON_DEPTH} deep"
LONG = f"a number in the body has more than {MAX_NUMBER_DIGITS} digits"


class BodyError(ValueError):
    """A body no route may read; the message says why (the guard's 400)."""


def decode(body: bytes) -> str:
    """The body's text, decoded as ``json.loads`` would decode it; only UTF-8."""
    encoding = json.detect_encoding(body)
    if encoding not in UTF8:
        raise BodyError(f"the body is {encoding.upper()} text: send JSON as UTF-8 (RFC 8259)")
    try:
        return body.decode(encoding)
    except UnicodeDecodeError as e:
        raise BodyError(f"malformed JSON: the body is not UTF-8 ({e.reason} at byte {e.start})") from None


def parse_body(body: bytes) -> dict:
    """The body's JSON object, checked (module docstring); ``BodyError`` otherwise."""
    text = decode(body)
    try:
        value = json.loads(text, parse_constant=_constant)
    except RecursionError:
        raise BodyError(f"malformed JSON: {DEEP}") from None
    except BodyError:
        raise
    except ValueError as e:  # JSONDecodeError; an integer past Python's 4,300 digits
        if "integer string conversion" in str(e):
            raise BodyError(f"malformed JSON: {LONG}") from None
        raise BodyError(f"malformed JSON: {e}") from None
    if not isinstance(value, dict):
        raise BodyError(f"the request body must be a JSON object, not {type(value).__name__}")
    bound(value, strings=_SURROGATE_ESCAPE.search(text) is not None)
    return value


def bound(root: Any, strings: bool = True) -> None:
    """``BodyError`` if ``root`` nests deeper than ``MAX_JSON_DEPTH`` (a scalar is 0 deep,
    ``[]`` 1), holds an integer outside 64 bits or a float that is not finite, or, with
    ``strings``, a key or string with a lone surrogate. Iterative: no depth of input can
    exhaust the stack."""
    stack = [([root], 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise BodyError(f"malformed JSON: {DEEP}")
        if type(node) is dict:
            if strings:
                for key in node:
                    _check_string(key)
            children = node.values()
        else:
            children = node
        for child in children:
            kind = type(child)
            if kind is dict or kind is list:
                stack.append((child, depth + 1))
            elif kind is int:
                if not INT_MIN <= child <= INT_MAX:
                    raise BodyError(_int_range(child))
            elif kind is float:
                if not math.isfinite(child):
                    raise BodyError("a number in the body is out of range: it does not fit in a 64-bit float")
            elif strings and kind is str:
                _check_string(child)


def _check_string(value: Any) -> None:
    if isinstance(value, str) and _LONE_SURROGATE.search(value):
        raise BodyError(
            "a string in the body holds a lone UTF-16 surrogate (a \\ud800-\\udfff "
            "escape without its pair), which is not text"
        )


def _int_range(value: int) -> str:
    if abs(value) >= 10**MAX_NUMBER_DIGITS:
        return f"malformed JSON: {LONG}"
    return f"an integer in the body is out of range: {value} does not fit in 64 bits (-2**63 to 2**63 - 1)"


def _constant(name: str) -> Any:
    raise BodyError(f"malformed JSON: {name} is not a JSON number")
