"""The base of every document: :class:`Schema`, :class:`Document` and its header check, the
number types and limits, the JSON a document is written as and its one reader.

Every arrow of the data flow (docs/ARCHITECTURE.md) is one of the pydantic models built on
these (:mod:`qsync_opt.documents.schemas` names them all).

All models are frozen and forbid unknown fields. The ones written to disk derive from
:class:`Document` and carry ``schema_name`` and ``schema_version``; a reader refuses a file of
another kind or of a version it does not know, with a message that says which. Units are in
the field names (``_ms``, ``_bytes``, ``_gb_per_s``, ``_us``, ``_tflops``); FLOPs count a
multiply-add as two.

Numbers are checked for the whole class of input, not field by field: every float of every
schema must be finite (``allow_inf_nan=False``: Infinity and NaN are refused naming the
field; only SolveReport, an output no command reads, may hold a bound of -inf); integer and float fields refuse ``true``/``false`` and strings (:data:`Int`,
:data:`Real`: a bool is an int in Python); sizes have sane upper limits, named in the
message (:data:`MAX_GROUPS`, :data:`MAX_DEVICES`, :data:`MAX_DEVICES_PER_NODE`,
:data:`MAX_BATCH`, :data:`MAX_OPS`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Self, TypeVar

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from qsync_opt.core.errors import (
    QsyncInputError,
    SchemaVersionError,
    describe_validation_error,
    one_line,
)
from qsync_opt.documents.files import atomic_write_text, check_depth, read_json

NAME_RE = r"^[A-Za-z_][A-Za-z0-9_\-]*$"
#: A device name: a catalog key, or a derived CPU such as ``cpu/2:4g~t4`` (costs/devices.py).
DEVICE_NAME_RE = r"^[A-Za-z_][A-Za-z0-9_\-]*(/[0-9.]+(:[0-9.]+[gm])?(~[A-Za-z0-9_]+)?)?(:int4)?$"
FLOP_CONVENTION = "a multiply-add counts as 2 FLOPs"

JSONScalar = float | int | str | bool | None

#: Sane limits. Beyond them an input is a mistake (10^30 devices, a batch of 25 digits), and
#: the solvers' integer scaling or a quadratic check would loop on it.
MAX_GROUPS = 1024  # device groups in a cluster (decision copies of the program)
MAX_DEVICES = 1_000_000  # devices in a group, and in the whole cluster
MAX_DEVICES_PER_NODE = 1024
MAX_BATCH = 1_048_576  # samples per device per iteration (2**20)
MAX_OPS = 100_000  # operators in a graph

#: Validation context of a document read from a file (see :func:`parse_document`).
FROM_FILE = "qsync_from_file"


def _no_bool_or_str(kind: str) -> Any:
    def check(v: Any) -> Any:
        if isinstance(v, (bool, str, bytes)):
            raise ValueError(f"expected {kind}, got {json.dumps(v) if isinstance(v, bool) else repr(v)}")
        return v
    return BeforeValidator(check)


#: An integer field: ``true``/``false`` and strings are refused (pydantic's lax mode takes
#: ``true`` as 1 and ``"16"`` as 16).
Int = Annotated[int, _no_bool_or_str("an integer")]
#: A float field (finite: every schema has ``allow_inf_nan=False``); bools and strings refused.
Real = Annotated[float, _no_bool_or_str("a number")]


#: Hashes of documents, computed once each: (id, kind) -> (weak reference, hash).
_HASHES: dict[tuple[int, str], tuple[weakref.ref[Any], str]] = {}


def memo(doc: Any, kind: str, compute: Callable[[], str]) -> str:
    """``compute()`` for ``doc``, once per document: the schemas are frozen, so a
    document's hash never changes (``model_copy`` makes a new document, hashed anew). The
    entry goes when the document does."""
    key = (id(doc), kind)
    hit = _HASHES.get(key)
    if hit is not None and hit[0]() is doc:
        return hit[1]
    value = compute()

    def gone(ref: weakref.ref[Any], key: tuple[int, str] = key) -> None:
        if _HASHES.get(key, (None, ""))[0] is ref:
            del _HASHES[key]

    _HASHES[key] = (weakref.ref(doc, gone), value)
    return value


class Schema(BaseModel):
    """Base of every schema: frozen, unknown fields refused, every float finite."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False,
                              allow_inf_nan=False)


def finite_or_none(values: Any, field: str, info: ValidationInfo) -> Any:
    """Free-form JSON scalars (provenance, options): a non-finite float made in memory (a
    solver's bound of -inf) becomes None, as it is written to JSON; one read from a file is
    refused, naming the key."""
    if not isinstance(values, dict):
        return values
    from_file = bool(info.context and info.context.get(FROM_FILE))
    out = {}
    for k, v in values.items():
        if isinstance(v, float) and not math.isfinite(v):
            if from_file:
                raise ValueError(f"{field}.{k}: Input should be a finite number")
            v = None
        out[k] = v
    return out


def written(value: object) -> str:
    """A parsed JSON value spelled as in the file where Python's repr differs (``true``,
    ``null``); strings quoted."""
    return json.dumps(value) if value is None or isinstance(value, bool) else repr(value)


def header_problem(data: dict[str, Any], cls: type[Document]) -> str | None:
    """What is wrong with a document's header for ``cls`` (another ``schema_name``, or a
    ``schema_version`` that is not exactly the integer this qsync-opt reads: ``true`` is not
    1, ``1.0`` is not 1), or None; a missing field reads as ``cls``'s. The one version check:
    :class:`Document`'s validator and :func:`parse_document` both call it."""
    name = data.get("schema_name", cls.SCHEMA_NAME)
    versions = cls.SCHEMA_VERSIONS or (cls.SCHEMA_VERSION,)
    version = data.get("schema_version", versions[0])
    if name != cls.SCHEMA_NAME:
        return f"schema_name is {written(name)}, expected {cls.SCHEMA_NAME!r}"
    if type(version) is not int or version not in versions:
        which = (f"version {versions[0]}" if len(versions) == 1 else
                 "versions " + ", ".join(map(str, versions)))
        return (f"schema_version {written(version)} of {cls.SCHEMA_NAME} is not one this "
                f"qsync-opt reads (it reads {which})")
    return None


class Document(Schema):
    """A schema that is written to disk. Subclasses set ``SCHEMA_NAME``/``SCHEMA_VERSION``."""

    SCHEMA_NAME: ClassVar[str] = "Document"
    SCHEMA_VERSION: ClassVar[int] = 1
    #: Every version this qsync-opt reads (empty: ``SCHEMA_VERSION`` only); a missing
    #: ``schema_version`` reads as the first.
    SCHEMA_VERSIONS: ClassVar[tuple[int, ...]] = ()

    schema_name: str = Field("Document", description="Kind of document; fixed per schema.")
    schema_version: Int = Field(1, description="Version of that schema's layout.")

    @model_validator(mode="before")
    @classmethod
    def _check_header(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        problem = header_problem(data, cls)
        if problem is not None:
            raise ValueError(problem)
        data["schema_name"] = data.get("schema_name", cls.SCHEMA_NAME)
        data["schema_version"] = data.get("schema_version",
                                          (cls.SCHEMA_VERSIONS or (cls.SCHEMA_VERSION,))[0])
        return data

    def save(self, path: str | os.PathLike[str], *, what: str | None = None) -> Path:
        """Write this document as JSON (:func:`to_json`), atomically (see
        :func:`qsync_opt.documents.files.atomic_write`); ``what``: the flag or field the path came
        from, named by a failed write."""
        return atomic_write_text(path, to_json(self), what=what)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        """Read a document of this type from a JSON file, refusing other kinds and versions
        clearly (:func:`parse_document`)."""
        return parse_document(read_json(path), cls, where=str(path))

    def content_hash(self) -> str:
        """sha256 of the canonical JSON, the first 16 hex digits (provenance, plan checks);
        computed once per document (:func:`memo`)."""
        def compute() -> str:
            payload = json.dumps(self.model_dump(mode="json"), sort_keys=True,
                                 separators=(",", ":"))
            return hashlib.sha256(payload.encode()).hexdigest()[:16]

        return memo(self, "content", compute)


D = TypeVar("D", bound=Document)


def to_json(doc: Document, indent: int | None = 2) -> str:
    """A document's JSON as written to a file (the golden plans are this text)."""
    return doc.model_dump_json(indent=indent) + "\n"


def parse_document(data: object, cls: type[D], where: str = "") -> D:
    """Validate parsed JSON as ``cls``, refusing other kinds and unknown versions clearly."""
    prefix = f"{where}: " if where else ""
    if not isinstance(data, dict):
        raise QsyncInputError(one_line(f"{prefix}expected a JSON object holding a "
                                       f"{cls.SCHEMA_NAME}"))
    check_depth(data, where)
    problem = header_problem(data, cls)
    if problem is not None:
        raise SchemaVersionError(one_line(prefix + problem))
    try:
        return cls.model_validate(data, context={FROM_FILE: True})
    except ValidationError as exc:
        raise QsyncInputError(describe_validation_error(exc, where)) from None
    except RecursionError:  # cannot happen below MAX_DEPTH; never a traceback
        raise QsyncInputError(one_line(f"{prefix}nested too deeply")) from None
