"""Fixed-width binary codec: the frame header and a tiny field grammar for message bodies.

Theory of operation
-------------------
Every control frame is a 24-byte little-endian header followed by a body::

    offset size field
    0      2    magic        b"KV"
    2      1    major        1
    3      1    minor        0..255 (additions only; this build speaks 4)
    4      1    msg_type     MsgType
    5      1    flags        bit set; unknown bits are ignored
    6      2    reserved     sent as 0, ignored on receipt
    8      8    room_id      u64, 0 for messages that concern no room
    16     4    generation   u32, the receiver-chosen incarnation of the room (0: none)
    20     4    body_len     u32, must equal the bytes that follow

A body is a sequence of fields, each of a fixed kind (``u8 u16 u32 u64 str bytes u32[] T[]``).
Strings carry a u16 byte length then UTF-8; byte strings a u32 length; arrays a u32 count.
A decoder reads the fields it knows in order. Fields appended by a later minor version are
*optional*: a body that ends before one decodes it as its default, and bytes after the last
known field are ignored. That is the whole compatibility rule for minor versions. An encoder
leaves out trailing optional fields that hold their defaults (an empty list), so a message that
uses no addition encodes exactly as the minor before it did.

Invariant: every input either decodes or raises a ``RemoteProtocolError`` subclass
(``MalformedFrame``, ``UnsupportedVersion``, ``FrameTooLarge``); nothing else escapes.

Speed: a room costs a handful of control frames at each end, on the same event loop that
drives the data plane, so the codec is on every room's path. Each body class's grammar is
compiled once into *steps* (``_steps``): a run of fixed-width integer fields that no minor
version may leave out becomes one ``struct`` call, every other field one step with its error
label made in advance. A step that meets bad input (a truncated run, a value out of range, a
wrong type) goes back to the field-by-field rules above, so errors read exactly as they did.

The bodies on every room's path (``TRANSFER_REQUEST`` with its per-group destinations, the
staging messages, ``TRANSFER_DONE``) hold only integers, ``u32[]`` and lists of such records.
For those, ``_Fast`` goes further: it writes out, once per class, one Python function that reads
(and one that writes) the whole body field by field with the offsets worked out in the code, the
way ``dataclasses`` writes ``__init__``. A fast function never raises and never guesses: on any
input it does not take as valid (a short body, a value out of range, a wrong type) it gives up and
the steps above run from the same offset, so every error is the steps' own; where it succeeds, it
produces what the steps would (``tests/wire/test_codec.py`` checks both on the same inputs, and
that the writer takes every valid body itself: giving up is always safe, so nothing else would
show a writer that always gives up). A reader takes a run of integers together with the count of
the ``u32[]`` after it in one ``struct`` call (a group's ``first_page`` and its page count), and an
empty ``u32[]`` (a state group's pages) without a call. ``_Fast.code(cls)`` shows the code written
for ``cls``.

A ``u32[]`` decodes to a tuple of ints, and the last one decoded is kept with its bytes
(``_u32s``): a list whose bytes equal it (a group that names the first group's pages, in the
same request) decodes to that very tuple, with no int made and none compared again; those who
take the lists can then tell by identity that they are one (``kvproto.core.groups.same_pages``,
the kernel path's table). Tuples are immutable, so sharing one between equal lists is safe.

*Repeated bodies.* Every TP rank of a decode engine sends a prefill rank the same
``TRANSFER_REQUEST`` body for a room (the engine's page table and slots are the same on all of
them; the header names the room). A class that says so (``Body.REPEATED``) keeps its last
``RECENT_BODIES`` decoded bodies by their bytes (``decode_body``): an equal body decodes to the
kept message (under another header, a copy with that header's fields), so its lists are the
very objects the first rank's request carried, nothing is decoded again, and the prefill's core
can tell by identity that a request names what another rank's request already passed
(``kvproto.core.sender``). A body that does not decode is never kept.

Why one module of ~730 lines: the header, the field grammar, the compiled steps and the written-out
fast functions are one codec whose layers must agree byte for byte (a fast function gives up to
the steps at the very offset it reached, and the steps fall back to the field-by-field rules), so
they are read and changed together; ``kvproto.wire.messages`` holds what the bodies are, and
``kvproto.wire.tags`` the notification tags.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
import types
from array import array
from collections.abc import Iterable
from typing import Any, ClassVar

from kvproto.wire.errors import FrameTooLarge, MalformedFrame, UnsupportedVersion

MAGIC = b"KV"
MAJOR = 1
MINOR = 6
HEADER = struct.Struct("<2sBBBBHQII")
HEADER_SIZE = HEADER.size  # 24
MAX_FRAME = 16 * 1024 * 1024
"""Frames larger than this are refused before decoding."""

_U = {"u8": struct.Struct("<B"), "u16": struct.Struct("<H"), "u32": struct.Struct("<I"), "u64": struct.Struct("<Q")}
_MAX = {"u8": 0xFF, "u16": 0xFFFF, "u32": 0xFFFFFFFF, "u64": 0xFFFFFFFFFFFFFFFF}
_U32 = _U["u32"]
_LITTLE = struct.pack("=H", 1) == struct.pack("<H", 1)


@dataclasses.dataclass(frozen=True, slots=True)
class Header:
    msg_type: int
    room_id: int = 0
    generation: int = 0
    flags: int = 0
    major: int = MAJOR
    minor: int = MINOR


class _Reader:
    __slots__ = ("buf", "pos", "end")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0
        self.end = len(buf)

    def at_end(self) -> bool:
        return self.pos >= self.end

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise MalformedFrame(f"truncated {what}: need {n} bytes at offset {self.pos}, have {self.end - self.pos}")
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def uint(self, kind: str, what: str) -> int:
        s = _U[kind]
        return s.unpack(self.take(s.size, what))[0]


class Body:
    """Base of message bodies: a frozen dataclass plus ``FIELDS``, the ordered field grammar.

    ``FIELDS`` rows are ``(name, kind)``; ``kind`` is one of ``u8 u16 u32 u64 str bytes u32[]``
    or a ``Body`` subclass (one nested record) or ``[SubBody]`` (a counted list of records).
    ``OPTIONAL_FROM`` is the index of the first field that a body may omit (minor additions).
    """

    FIELDS: ClassVar[tuple[tuple[str, Any], ...]] = ()
    OPTIONAL_FROM: ClassVar[int | None] = None
    REPEATED: ClassVar[bool] = False
    """Peers send this body again, byte for byte, under other headers: ``decode_body`` keeps the
    recent ones (module docstring, *repeated bodies*)."""

    def sent_fields(self) -> tuple[tuple[str, Any], ...]:
        """The fields this body puts on the wire: ``FIELDS`` without the trailing optional ones
        that hold their defaults."""
        return self.FIELDS[:self._sent_count()]

    def _sent_count(self) -> int:
        n = len(self.FIELDS)
        if self.OPTIONAL_FROM is not None:
            while n > self.OPTIONAL_FROM and _is_default(getattr(self, self.FIELDS[n - 1][0])):
                n -= 1  # a trailing addition left at its default is not sent
        return n

    def encode_into(self, out: bytearray) -> None:
        fast = _Fast.of(type(self))
        if fast is not None:
            at = len(out)
            if fast.write(self, out):
                return
            del out[at:]  # the steps write it again, and raise what they raise
        self.encode_steps(out)

    def encode_steps(self, out: bytearray) -> None:
        """``encode_into`` by the compiled steps alone (what a fast writer must match)."""
        sent = self._sent_count()
        for step in _steps(type(self)):
            if step.index >= sent:
                break
            step.write(self, out)

    @classmethod
    def decode_from(cls, r: _Reader, **header_fields: int) -> Any:
        fast = _Fast.of(cls)
        if fast is not None:
            got = fast.read(r.buf, r.pos, r.end, header_fields)
            if got is not None:
                r.pos = got[1]
                return got[0]
        return cls.decode_steps(r, **header_fields)

    @classmethod
    def decode_steps(cls, r: _Reader, **header_fields: int) -> Any:
        """``decode_from`` by the compiled steps alone (what a fast reader must match)."""
        values: dict[str, Any] = header_fields
        for step in _steps(cls):
            if step.optional and r.pos >= r.end:
                break  # absent optional fields take their defaults
            ints = step.ints
            if ints is None:
                values[step.name] = step.read(r)
            elif r.pos + ints.size <= r.end:
                values.update(zip(step.names, ints.unpack_from(r.buf, r.pos)))
                r.pos += ints.size
            else:  # truncated: the field-by-field error
                for (name, kind), what in zip(step.fields, step.whats):
                    values[name] = _decode_field(r, kind, what)
        try:
            return cls(**values)
        except (TypeError, ValueError) as exc:
            raise MalformedFrame(f"invalid {cls.__name__}: {exc}") from None


@dataclasses.dataclass(frozen=True, slots=True)
class _Step:
    """One step of a body's compiled grammar: a run of fixed-width integer fields (``ints``, a
    ``struct`` over all of them) or one field of any other kind (``name``, ``kind``, ``what``:
    its label in error messages)."""

    index: int
    """The position of the step's first field in ``FIELDS``."""
    optional: bool
    """Whether a body may end before this step (minor additions)."""
    name: str
    kind: Any
    what: str
    fields: tuple[tuple[str, Any], ...]
    """Every field of the step (a run's, or the one), with ``whats`` their labels."""
    whats: tuple[str, ...]
    names: tuple[str, ...]
    read: Any
    """The one field's decoder (``reader -> value``); None for a run."""
    write: Any
    """The step's encoder (``(body, out) -> None``)."""
    ints: struct.Struct | None = None


_LAST_U32S: tuple[bytes, tuple[int, ...]] = (b"", ())
"""The last ``u32[]`` decoded: its bytes and its tuple (one object, swapped whole: threads that
decode at once each see a matching pair)."""


def _u32s(buf: Any, start: int, stop: int) -> tuple[int, ...]:
    """The ``u32[]`` whose elements are ``buf[start:stop]`` (checked to lie in the body): the last
    decoded tuple again when its bytes are the same."""
    global _LAST_U32S
    if start == stop:
        return ()  # (a state group's destination names no pages: the list kept stays kept)
    raw = bytes(buf[start:stop])
    last = _LAST_U32S
    if raw == last[0]:
        return last[1]
    arr = array("I")
    arr.frombytes(raw)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    pages = tuple(arr)
    _LAST_U32S = (raw, pages)
    return pages


_LAST_U32S_OUT: tuple[Any, bytes] = ((), b"")
"""The last tuple ``_u32s_out`` encoded, and its bytes (count and elements)."""


_NO_U32S = b"\0\0\0\0"
"""An empty ``u32[]``: its count alone."""


def _u32s_out(values: tuple[int, ...] | list[int]) -> bytes:
    """A ``u32[]``'s bytes, count first; a tuple encoded just before (the same object, as a
    request names for a group on the first group's pages) is not encoded again. Raises what
    ``array`` raises on an element that does not fit."""
    global _LAST_U32S_OUT
    if not values:
        return _NO_U32S
    last = _LAST_U32S_OUT
    if values is last[0]:
        return last[1]
    arr = array("I", values)
    data = _U32.pack(len(arr)) + arr.tobytes()
    if values.__class__ is tuple:
        _LAST_U32S_OUT = (values, data)
    return data


_STEPS: dict[type, tuple[_Step, ...]] = {}
_INT_CODE = {"u8": "B", "u16": "H", "u32": "I", "u64": "Q"}


def _reader(kind: Any, what: str) -> Any:
    """A decoder of one field of ``kind`` (``_decode_field``'s rules, its common kinds inlined)."""
    if kind == "u32[]":
        def read_u32s(r: _Reader) -> tuple[int, ...]:
            pos = r.pos
            if pos + 4 <= r.end:
                (n,) = _U32.unpack_from(r.buf, pos)
                if pos + 4 + 4 * n <= r.end:
                    r.pos = pos + 4 + 4 * n
                    return _u32s(r.buf, pos + 4, r.pos)
            return _decode_field(r, kind, what)  # truncated: its error
        return read_u32s
    if isinstance(kind, list):
        (sub,) = kind

        def read_records(r: _Reader) -> tuple[Any, ...]:
            n = r.uint("u32", what)
            if n > r.end - r.pos:  # every record takes at least one byte: cheap bound
                raise MalformedFrame(f"{what}: count {n} exceeds the frame")
            return tuple([sub.decode_from(r) for _ in range(n)])
        return read_records
    if isinstance(kind, type):
        return kind.decode_from
    return lambda r: _decode_field(r, kind, what)


def _int_writer(ints: struct.Struct, get: Any, n: int, fields: tuple[tuple[str, Any], ...],
                whats: tuple[str, ...]) -> Any:
    """The encoder of a run of integer fields: one ``pack``; anything it refuses (a value out of
    range, not an int) goes field by field, for ``_encode_field``'s errors."""
    def write(body: Body, out: bytearray) -> None:
        values = get(body) if n > 1 else (get(body),)
        for v in values:
            if type(v) is not int:
                break
        else:
            try:
                out += ints.pack(*values)
                return
            except struct.error:
                pass
        for (name, kind), what in zip(fields, whats):
            _encode_field(out, kind, getattr(body, name), what)
    return write


def _writer(name: str, kind: Any, what: str) -> Any:
    """The encoder of one field that is not part of a run of integers."""
    get = operator.attrgetter(name)
    return lambda body, out: _encode_field(out, kind, get(body), what)


def _steps(cls: type[Body]) -> tuple[_Step, ...]:
    """``cls``'s grammar compiled (once): consecutive integer fields before ``OPTIONAL_FROM``
    joined into one step, every other field a step of its own."""
    steps = _STEPS.get(cls)
    if steps is not None:
        return steps
    optional_from = len(cls.FIELDS) if cls.OPTIONAL_FROM is None else cls.OPTIONAL_FROM
    out: list[_Step] = []
    run: list[tuple[int, str, str]] = []

    def close_run() -> None:
        if run:
            names = tuple(name for _, name, _ in run)
            whats = tuple(f"{cls.__name__}.{name}" for name in names)
            get = operator.attrgetter(*names)
            ints = struct.Struct("<" + "".join(_INT_CODE[kind] for _, _, kind in run))
            fields = tuple((name, kind) for _, name, kind in run)
            out.append(_Step(run[0][0], False, names[0], run[0][2], whats[0], fields, whats, names, None,
                             _int_writer(ints, get, len(names), fields, whats), ints))
            run.clear()

    for i, (name, kind) in enumerate(cls.FIELDS):
        if isinstance(kind, str) and kind in _INT_CODE and i < optional_from:
            run.append((i, name, kind))
            continue
        close_run()
        what = f"{cls.__name__}.{name}"
        out.append(_Step(i, i >= optional_from, name, kind, what, ((name, kind),), (what,), (name,),
                         _reader(kind, what), _writer(name, kind, what)))
    close_run()
    steps = _STEPS[cls] = tuple(out)
    return steps


def _is_default(value: Any) -> bool:
    """Optional fields default to empty: an empty list, string or byte string, or 0."""
    return value == 0 if isinstance(value, int) else len(value) == 0


def _encode_field(out: bytearray, kind: Any, value: Any, what: str) -> None:
    if isinstance(kind, str):
        if kind in _U:
            if not isinstance(value, int):
                raise TypeError(f"{what}: expected int, got {type(value).__name__}")
            if not 0 <= value <= _MAX[kind]:
                raise ValueError(f"{what}: {value} does not fit {kind}")
            out += _U[kind].pack(value)
        elif kind == "str":
            if not isinstance(value, str):
                raise TypeError(f"{what}: expected str, got {type(value).__name__}")
            data = value.encode("utf-8")
            if len(data) > 0xFFFF:
                raise ValueError(f"{what}: string of {len(data)} bytes exceeds 65535")
            out += _U["u16"].pack(len(data))
            out += data
        elif kind == "bytes":
            if not isinstance(value, (bytes, bytearray, memoryview)):
                raise TypeError(f"{what}: expected bytes, got {type(value).__name__}")
            data = bytes(value)
            out += _U["u32"].pack(len(data))
            out += data
        elif kind == "u32[]":
            if isinstance(value, (str, bytes, bytearray, memoryview)):
                raise TypeError(f"{what}: expected a sequence of ints, got {type(value).__name__}")
            try:
                arr = value if isinstance(value, array) and value.typecode == "I" else array("I", value)
            except OverflowError:
                raise ValueError(f"{what}: an element does not fit u32") from None
            except TypeError:
                raise TypeError(f"{what}: expected a sequence of ints") from None
            if not _LITTLE:  # pragma: no cover - big-endian hosts
                arr = array("I", arr)
                arr.byteswap()
            out += _U["u32"].pack(len(arr))
            out += arr.tobytes()
        else:  # pragma: no cover - grammar bug
            raise AssertionError(f"unknown field kind {kind!r}")
    elif isinstance(kind, list):
        (sub,) = kind
        out += _U["u32"].pack(len(value))
        for item in value:
            if not isinstance(item, sub):
                raise TypeError(f"{what}: expected {sub.__name__}, got {type(item).__name__}")
            item.encode_into(out)
    else:
        if not isinstance(value, kind):
            raise TypeError(f"{what}: expected {kind.__name__}, got {type(value).__name__}")
        value.encode_into(out)


def _decode_field(r: _Reader, kind: Any, what: str) -> Any:
    if isinstance(kind, str):
        if kind in _U:
            return r.uint(kind, what)
        if kind == "str":
            n = r.uint("u16", what)
            try:
                return str(r.take(n, what), "utf-8")
            except UnicodeDecodeError as exc:
                raise MalformedFrame(f"{what}: invalid UTF-8 ({exc.reason})") from None
        if kind == "bytes":
            return bytes(r.take(r.uint("u32", what), what))
        if kind == "u32[]":
            n = r.uint("u32", what)
            start = r.pos
            r.take(4 * n, what)
            return _u32s(r.buf, start, r.pos)
        raise AssertionError(f"unknown field kind {kind!r}")  # pragma: no cover
    if isinstance(kind, list):
        (sub,) = kind
        n = r.uint("u32", what)
        if n > r.end - r.pos:  # every record takes at least one byte: cheap bound
            raise MalformedFrame(f"{what}: count {n} exceeds the frame")
        return tuple(sub.decode_from(r) for _ in range(n))
    return kind.decode_from(r)


def _is_int(kind: Any) -> bool:
    return isinstance(kind, str) and kind in _INT_CODE


class _Fast:
    """A body's reader and writer written out as code (module docstring), for a class whose
    fields are integers, ``u32[]`` and lists of such records; ``of`` gives None for any other
    class (and on a big-endian host), which the steps alone decode and encode.

    ``read(buf, pos, end, head)`` returns ``(body, end offset)`` or None (not taken: the steps
    decode it from ``pos``); ``head`` holds the header's fields. ``write(body, out)`` appends the
    body and returns True, or returns False (``out`` maybe part-written: the caller cuts it)."""

    __slots__ = ("read", "write", "source")
    _KNOWN: ClassVar[dict[type, _Fast | None]] = {}

    def __init__(self, read: Any, write: Any, source: str) -> None:
        self.read = read
        self.write = write
        self.source = source

    @classmethod
    def of(cls, body: type) -> _Fast | None:
        try:
            return cls._KNOWN[body]
        except KeyError:
            pass
        cls._KNOWN[body] = None  # while a nested record is written out
        made = cls._make(body) if _LITTLE else None
        cls._KNOWN[body] = made
        return made

    @classmethod
    def _make(cls, body: type) -> _Fast | None:
        fields = body.FIELDS
        names = {name for name, _ in fields}
        env: dict[str, Any] = {"C": body, "U32": _U32, "U32S": _u32s, "U32S_OUT": _u32s_out, "struct_error": struct.error}
        for k, (_, kind) in enumerate(fields):
            if isinstance(kind, list):
                sub = cls.of(kind[0]) if isinstance(kind[0], type) and issubclass(kind[0], Body) else None
                if sub is None:
                    return None
                env[f"R{k}"], env[f"W{k}"], env[f"T{k}"] = sub.read, sub.write, kind[0]
            elif kind != "u32[]" and not _is_int(kind):
                return None
        if "head" in names or any(not name.isidentifier() for name in names):  # pragma: no cover
            return None
        optional = len(fields) if body.OPTIONAL_FROM is None else body.OPTIONAL_FROM
        read = ["def read(buf, pos, end, head):", "    try:"]
        write = ["def write(body, out):", "    try:"]
        # encode: trailing optional fields holding their defaults are not sent (Body._sent_count)
        sent_from = len(fields)
        for k in range(len(fields) - 1, optional - 1, -1):
            name, kind = fields[k]
            empty = f"body.{name} == 0" if _is_int(kind) else f"len(body.{name}) == 0"
            write.append(f"        {'if' if k == len(fields) - 1 else 'elif'} not ({empty}): sent = {k + 1}")
            sent_from = k
        if sent_from < len(fields):
            write.append(f"        else: sent = {optional}")
        k = 0
        while k < len(fields):
            name, kind = fields[k]
            if k >= optional:  # a body may end before an optional field: the rest take their defaults
                given = ", ".join(f"{n}=f{j}" for j, (n, _) in enumerate(fields[:k]))
                read.append(f"        if pos >= end: return C({given}{', ' if given else ''}**head), pos")
                write.append(f"        if sent <= {k}: return True")
            if _is_int(kind):
                run = [k]  # consecutive integers before the optional ones: one struct
                while k + 1 < optional and _is_int(fields[k + 1][1]):
                    k += 1
                    run.append(k)
                counted = k + 1 < optional and fields[k + 1][1] == "u32[]"
                read += cls._int_reads(env, fields, run, "f", f"S{run[0]}", "        ", counted)
                values = ", ".join(f"body.{fields[j][0]}" for j in run)
                write += [f"        v = ({values},)", "        for x in v:",
                          "            if not isinstance(x, int): return False",
                          f"        out += S{run[0]}.pack(*v)"]
                if counted:  # the list whose count that struct read
                    k += 1
                    read += cls._u32s_reads(f"f{k}", "        ", counted=True)
                    write += cls._u32s_writes(fields[k][0])
            elif kind == "u32[]":
                read += cls._u32s_reads(f"f{k}", "        ")
                write += cls._u32s_writes(name)
            else:  # a list of records
                read += ["        if pos + 4 > end: return None", "        n, = U32.unpack_from(buf, pos)",
                         "        pos += 4", "        if n > end - pos: return None", "        items = []",
                         "        for _ in range(n):"]
                inline = cls._record_reads(kind[0], env, f"R{k}_")
                if inline is None:
                    read += [f"            got = R{k}(buf, pos, end, NO_HEAD)", "            if got is None: return None",
                             "            items.append(got[0])", "            pos = got[1]"]
                else:  # the record's fields read here, in the loop: no call per record
                    read += inline + ["            items.append(o)"]
                read += [f"        f{k} = tuple(items)"]
                write += [f"        v = body.{name}", "        if v.__class__ is not tuple and v.__class__ is not list:",
                          "            return False", "        out += U32.pack(len(v))", "        for x in v:",
                          f"            if x.__class__ is not T{k} or not W{k}(x, out): return False"]
            k += 1
        given = ", ".join(f"{n}=f{j}" for j, (n, _) in enumerate(fields))
        if cls._settable(body):  # a record (no header fields): built without its __init__
            read += cls._new_reads(body, env, "", "f", "        ")
            read += ["        return o, pos"]
        else:
            read += [f"        return C({given}{', ' if given else ''}**head), pos"]
        read += ["    except (TypeError, ValueError):", "        return None"]
        write += ["        return True", "    except (TypeError, ValueError, OverflowError, struct_error):",
                  "        return False"]
        env["NO_HEAD"] = {}
        source = "\n".join(read) + "\n\n\n" + "\n".join(write) + "\n"
        exec(compile(source, f"<kvproto.wire codec for {body.__name__}>", "exec"), env)  # noqa: S102 - our own text
        return cls(env["read"], env["write"], source)

    @staticmethod
    def _int_reads(env: dict[str, Any], fields: Any, run: list[int], var: str, struct_name: str,
                   ind: str, counted: bool = False) -> list[str]:
        """Lines that read the integer fields ``run`` (one ``struct``) into ``{var}{j}``; with
        ``counted``, the count of the ``u32[]`` that follows them too, into ``n`` (one call where
        there were two: a record of a slot and a page list is read with two)."""
        codes = "".join(_INT_CODE[fields[j][1]] for j in run)
        env[struct_name] = struct.Struct("<" + codes)  # (the writer packs the run with it)
        if counted:
            struct_name += "N"
            env[struct_name] = struct.Struct("<" + codes + "I")
        ints = env[struct_name]
        got = ", ".join([f"{var}{j}" for j in run] + (["n"] if counted else []))
        return [f"{ind}if pos + {ints.size} > end: return None", f"{ind}{got}, = {struct_name}.unpack_from(buf, pos)",
                f"{ind}pos += {ints.size}"]

    @staticmethod
    def _u32s_reads(target: str, ind: str, counted: bool = False) -> list[str]:
        """Lines that read a ``u32[]`` into ``target`` (``counted``: its count already read into
        ``n``, ``pos`` past it); an empty one (a state group's pages) is ``()`` without a call."""
        count = [] if counted else [f"{ind}if pos + 4 > end: return None", f"{ind}n, = U32.unpack_from(buf, pos)",
                                    f"{ind}pos += 4"]
        return count + [f"{ind}stop = pos + 4 * n", f"{ind}if stop > end: return None",
                        f"{ind}{target} = U32S(buf, pos, stop) if n else ()", f"{ind}pos = stop"]

    @staticmethod
    def _u32s_writes(name: str) -> list[str]:
        """Lines that write the ``u32[]`` field ``name``."""
        return [f"        v = body.{name}", "        if v.__class__ is not tuple and v.__class__ is not list:",
                "            return False", "        out += U32S_OUT(v)"]

    @staticmethod
    def _new_reads(body: type, env: dict[str, Any], key: str, var: str, ind: str) -> list[str]:
        """Lines that make ``o``, a ``body`` whose slots take ``{var}{j}`` (``_settable``)."""
        env["NEW"] = object.__new__
        env[f"C{key}"] = body
        lines = [f"{ind}o = NEW(C{key})"]
        for j, (n, _) in enumerate(body.FIELDS):
            env[f"SET{key}{j}"] = getattr(body, n).__set__
            lines.append(f"{ind}SET{key}{j}(o, {var}{j})")
        return lines

    @classmethod
    def _record_reads(cls, sub: type, env: dict[str, Any], key: str) -> list[str] | None:
        """Lines, inside the loop over a list of ``sub`` records, that read one into ``o``: for a
        record of integers and ``u32[]`` only, every field required, built as ``_settable`` says;
        None for any other (its own reader is called)."""
        fields = sub.FIELDS
        if sub.OPTIONAL_FROM is not None or not cls._settable(sub) or not all(
                _is_int(kind) or kind == "u32[]" for _, kind in fields):
            return None
        ind, lines, k = "            ", [], 0
        while k < len(fields):
            if fields[k][1] == "u32[]":
                lines += cls._u32s_reads(f"{key}{k}", ind)
            else:
                run = [k]
                while k + 1 < len(fields) and _is_int(fields[k + 1][1]):
                    k += 1
                    run.append(k)
                counted = k + 1 < len(fields) and fields[k + 1][1] == "u32[]"
                lines += cls._int_reads(env, fields, run, key, f"S{key}{run[0]}", ind, counted)
                if counted:
                    k += 1
                    lines += cls._u32s_reads(f"{key}{k}", ind, counted=True)
            k += 1
        return lines + cls._new_reads(sub, env, key, key, ind)

    @staticmethod
    def _settable(body: type) -> bool:
        """Whether ``body`` is a record whose every field is a slot that its whole decoded value
        fills, with nothing for ``__init__`` to add (no header fields, no ``__post_init__``): its
        reader then sets the slots of a new object, a third of the cost of the keyword call."""
        if not dataclasses.is_dataclass(body) or hasattr(body, "__post_init__"):
            return False
        names = [f.name for f in dataclasses.fields(body)]
        return names == [name for name, _ in body.FIELDS] and all(
            isinstance(body.__dict__.get(name), types.MemberDescriptorType) for name in names)

    @classmethod
    def code(cls, body: type) -> str | None:
        """The code written for ``body`` (None: the steps alone read and write it)."""
        fast = cls.of(body)
        return None if fast is None else fast.source


# --- frames ------------------------------------------------------------------------------


def compile_bodies(bodies: Iterable[type[Body]]) -> None:
    """Compile now what encoding and decoding each of ``bodies`` and of the records inside them
    needs (its steps and its fast reader and writer), which would otherwise be built at the
    first frame of each type: an endpoint does it when it starts, so that its first room
    compiles no code."""
    todo = list(bodies)
    while todo:
        body = todo.pop()
        _steps(body)
        _Fast.of(body)
        for _, kind in body.FIELDS:  # the records inside it, alone or listed
            inner = kind[0] if isinstance(kind, list) else kind
            if isinstance(inner, type) and issubclass(inner, Body):
                todo.append(inner)


def encode_frame(header: Header, body: Body) -> bytes:
    out = bytearray(HEADER_SIZE)
    body.encode_into(out)
    body_len = len(out) - HEADER_SIZE
    if len(out) > MAX_FRAME:
        raise ValueError(f"frame of {len(out)} bytes exceeds MAX_FRAME {MAX_FRAME}")
    try:
        HEADER.pack_into(
            out, 0, MAGIC, header.major, header.minor, header.msg_type, header.flags, 0,
            header.room_id, header.generation, body_len,
        )
    except struct.error as exc:
        raise ValueError(f"header field out of range: {exc}") from None
    return bytes(out)


def decode_header(frame: bytes | memoryview) -> tuple[Header, memoryview]:
    """Split a frame into its header and body view, checking magic, version and length."""
    view = memoryview(frame)
    if len(view) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(view)} bytes exceeds the bound {MAX_FRAME}")
    if len(view) < HEADER_SIZE:
        raise MalformedFrame(f"frame of {len(view)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, major, minor, msg_type, flags, _reserved, room_id, generation, body_len = HEADER.unpack_from(view)
    if magic != MAGIC:
        raise MalformedFrame(f"bad magic {bytes(magic)!r}")
    if major != MAJOR:
        raise UnsupportedVersion(f"major version {major} is not supported (this side speaks {MAJOR})", major)
    if body_len != len(view) - HEADER_SIZE:
        raise MalformedFrame(f"body_len {body_len} but {len(view) - HEADER_SIZE} body bytes follow")
    return Header(msg_type, room_id, generation, flags, major, minor), view[HEADER_SIZE:]


def peek_header(frame: bytes | memoryview) -> Header | None:
    """The header fields of a frame that failed to decode, for blame and replies only:
    ``None`` unless it is at least a header long with the right magic. Never raises."""
    if len(frame) < HEADER_SIZE:
        return None
    magic, major, minor, msg_type, flags, _reserved, room_id, generation, _len = HEADER.unpack_from(frame)
    if magic != MAGIC:
        return None
    return Header(msg_type, room_id, generation, flags, major, minor)


RECENT_BODIES = 64
"""Bodies of ``REPEATED`` classes kept (module docstring): the requests of the rooms whose other
TP ranks have not sent theirs yet."""
_RECENT: dict[tuple[type, bytes], Any] = {}


def decode_body(cls: type[Body], body: memoryview, **header_fields: int) -> Any:
    if not cls.REPEATED:
        return cls.decode_from(_Reader(body), **header_fields)
    key = (cls, bytes(body))
    kept = _RECENT.get(key)
    if kept is not None:
        return _with_header(kept, header_fields)
    msg = cls.decode_from(_Reader(body), **header_fields)
    if len(_RECENT) >= RECENT_BODIES:
        try:
            del _RECENT[next(iter(_RECENT))]  # the oldest
        except (KeyError, RuntimeError, StopIteration):  # another thread's decode changed it meanwhile
            pass
    _RECENT[key] = msg
    return msg


def _with_header(msg: Any, header_fields: dict[str, int]) -> Any:
    """``msg`` with the header's fields (``msg`` itself where they are its own): a new object whose
    other fields are ``msg``'s very values."""
    if all(getattr(msg, name) == value for name, value in header_fields.items()):
        return msg
    setters = _SETTERS.get(type(msg))
    if setters is None:
        setters = _SETTERS[type(msg)] = tuple(
            (f.name, getattr(type(msg), f.name).__set__) for f in dataclasses.fields(msg))
    copy = object.__new__(type(msg))
    for name, put in setters:
        put(copy, header_fields[name] if name in header_fields else getattr(msg, name))
    return copy


_SETTERS: dict[type, tuple[tuple[str, Any], ...]] = {}
