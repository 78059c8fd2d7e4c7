"""The program that runs inside the sandbox, and the value format it shares with the trusted side.

This file is both a script and a module. As a script (`python -I -S _runner.py MODE`), it is what every
sandboxed child executes: it imports only the standard library, because the child runs without site
packages and must not import rlpipe. As a module, the trusted side imports `encode_value` /
`decode_value` from it, so both ends agree on the wire format by construction.

Modes:
- `script`: read the candidate's source from fd 3 and execute it as `__main__` (stdin/stdout cases).
- `serve`: read the candidate's source from fd 3, execute it as a module, then answer call requests:
  each request names the entry point and carries arguments; the reply carries the return value in the
  restricted format below, or the exception the candidate raised. The candidate never sees a test or an
  expected value: the trusted side runs the test code and compares.

Nothing this process says is trusted beyond "these are plain values": the candidate can replace any of
the code below (it runs in the same interpreter), so the trusted side decodes replies into builtin types
only and draws every verdict itself.

Wire format: frames of a 4-byte big-endian length and a JSON document. Values are JSON with tags for
what JSON lacks: lists are arrays; tuple, dict, set, frozenset, bytes and complex are one-key objects
({"t": [...]}, {"d": [[k, v], ...]}, {"s": [...]}, {"f": [...]}, {"b": "hex"}, {"c": [re, im]}); floats
keep nan/inf through Python's JSON extensions. Only exact builtin types are encoded: a subclass (an int
whose __eq__ always answers True, say) is refused, so what the trusted side compares is what it decoded.
"""

from __future__ import annotations

import json
import os
import struct
import sys

HEADER = struct.Struct(">I")
# The trusted side refuses deeper values before they can exhaust its stack.
MAX_DEPTH = 100


class ValueFormatError(ValueError):
    """A value that is not made of plain builtin types (or a frame that does not decode into one)."""


def _encode(value: object, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise ValueFormatError("value nested too deeply")
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is float or kind is str:
        return value
    if kind is list:
        return [_encode(item, depth + 1) for item in value]
    if kind is tuple:
        return {"t": [_encode(item, depth + 1) for item in value]}
    if kind is dict:
        return {"d": [[_encode(k, depth + 1), _encode(v, depth + 1)] for k, v in value.items()]}
    if kind is set:
        return {"s": [_encode(item, depth + 1) for item in value]}
    if kind is frozenset:
        return {"f": [_encode(item, depth + 1) for item in value]}
    if kind is bytes:
        return {"b": value.hex()}
    if kind is complex:
        return {"c": [value.real, value.imag]}
    raise ValueFormatError(f"a {kind.__name__} object is not a plain builtin value")


def encode_value(value: object) -> object:
    """Plain builtin value -> JSON-ready structure; refuses anything else (including subclasses)."""
    return _encode(value, 0)


def _decode(node: object, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise ValueFormatError("value nested too deeply")
    kind = type(node)
    if node is None or kind is bool or kind is int or kind is float or kind is str:
        return node
    if kind is list:
        return [_decode(item, depth + 1) for item in node]
    if kind is dict and len(node) == 1:
        ((tag, body),) = node.items()
        if tag == "b" and type(body) is str:
            return bytes.fromhex(body)
        if type(body) is not list:
            raise ValueFormatError(f"bad tagged value {tag!r}")
        if tag == "c" and len(body) == 2 and all(type(x) in (int, float) for x in body):
            return complex(body[0], body[1])
        items = [_decode(item, depth + 1) for item in body]
        try:
            if tag == "t":
                return tuple(items)
            if tag == "s":
                return set(items)
            if tag == "f":
                return frozenset(items)
            if tag == "d":
                if not all(type(pair) is list and len(pair) == 2 for pair in items):
                    raise ValueFormatError("dict items must be pairs")
                return {k: v for k, v in items}
        except TypeError as error:  # an unhashable key or set member
            raise ValueFormatError(str(error)) from None
    raise ValueFormatError(f"not a value in the wire format: {type(node).__name__}")


def decode_value(node: object) -> object:
    """JSON structure -> value built from builtin types only (the trusted side's half)."""
    try:
        return _decode(node, 0)
    except RecursionError:
        raise ValueFormatError("value nested too deeply") from None


def read_frame(fd: int) -> bytes | None:
    """One frame from a blocking fd; None at end of file."""
    header = _read_exact(fd, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    return _read_exact(fd, length) if length else b""


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def write_frame(fd: int, payload: bytes) -> None:
    data = HEADER.pack(len(payload)) + payload
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _reply(fd: int, message: dict) -> None:
    write_frame(fd, json.dumps(message).encode())


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def _load(source: str, name: str) -> dict:
    namespace: dict = {"__name__": name, "__builtins__": __builtins__}
    sys.argv = ["main.py"]
    exec(compile(source, "main.py", "exec"), namespace)
    return namespace


def _serve(requests: int, replies: int) -> None:
    raw = read_frame(requests)
    if raw is None:
        return
    load = json.loads(raw)
    try:
        # Not "__main__": HumanEval's own harness executes the program in a dict whose __name__ resolves
        # to "builtins", so `if __name__ == "__main__":` blocks (doctest runs, input() prompts) stay off.
        namespace = _load(load["source"], "__candidate__")
        function = namespace.get(load["entry_point"])
        if not callable(function):
            _reply(replies, {"error": f"NameError: entry point {load['entry_point']!r} is not defined"})
            return
    except BaseException as error:  # SystemExit included: a program that exits on import did not load
        _reply(replies, {"error": _describe(error)})
        return
    _reply(replies, {"loaded": True})
    while True:
        raw = read_frame(requests)
        if raw is None:
            return
        request = json.loads(raw)
        args = decode_value(request["args"])
        kwargs = decode_value(request["kwargs"])
        try:
            result = function(*args, **kwargs)
        except BaseException as error:
            _reply(replies, {"raised": [type(error).__name__, _describe(error)]})
            continue
        try:
            _reply(replies, {"value": encode_value(result)})
        except (ValueFormatError, RecursionError) as error:
            _reply(replies, {"unencodable": str(error)})


def _script(requests: int) -> None:
    raw = read_frame(requests)
    os.close(requests)
    source = json.loads(raw)["source"] if raw else ""
    _load(source, "__main__")


if __name__ == "__main__":
    mode = sys.argv[1]
    sys.argv = sys.argv[:1]
    if mode == "serve":
        _serve(3, 4)
    else:
        _script(3)
