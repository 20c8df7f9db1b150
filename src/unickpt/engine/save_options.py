"""How one save writes (:class:`SaveOptions`), checked once, in one place, for every writer:
``unickpt.save``, ``unickpt.async_save`` and the DCP storage writer; and the way every
option group checks itself and names a bad value (:class:`Checked`).

Each option has two spellings at the public entry points: the flat keyword users write
(``save(..., block_bytes=12)``) and the group's field (``SaveOptions(block_bytes=12)``).
An entry point turns what it was given into the group once (:meth:`Checked.merged`), and
only the group travels inside. An error names what the user wrote: the keyword for the
flat spelling, ``Group.field`` for a group. How a group was spelled is kept beside it
(:class:`Given`) only as long as the entry point still checks it; the group itself holds
nothing but its values.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from types import SimpleNamespace
from typing import Any, ClassVar, Generic, NoReturn, TypeVar

from ..errors import SaveError, UnickptError
from ..format.manifest import DEFAULT_BLOCK_BYTES

__all__ = ["Checked", "Given", "SaveOptions", "Spelling", "whole"]

G = TypeVar("G", bound="Checked")


@dataclass(frozen=True)
class Spelling:
    """How the user wrote one group of options, and so what an error calls its fields:
    the flat keywords of a public entry point (``flat``) or the group itself.

    Attributes:
        group: The group's class (its ``KEYWORDS``, ``FLAT_VALUES`` and ``ERROR``).
        flat: True for the flat keywords, False for the group's fields.
    """

    group: type[Checked]
    flat: bool

    def name(self, field: str) -> str:
        """What an error calls ``field``: the flat keyword, or ``Group.field``."""
        if self.flat:
            return self.group.KEYWORDS.get(field, field)
        return f"{self.group.__name__}.{field}"

    def said(self, field: str, value: Any) -> str:
        """``field=value`` as the user wrote it (a flat keyword with its own value:
        ``async_save=True`` for ``mode="async"``)."""
        if self.flat:
            value = self.group.FLAT_VALUES.get(field, {}).get(value, value)
        return f"{self.name(field)}={value!r}"

    def fail(self, message: str) -> NoReturn:
        """Raise the group's error (a :class:`~unickpt.UnickptError`) with ``message``."""
        raise self.group.ERROR(message)


@dataclass(frozen=True)
class Given(Generic[G]):
    """One group as a public entry point was given it: the group, and how the user
    spelled it, for the checks across groups that the entry point still makes.

    Attributes:
        group: The group (the only thing that travels on).
        spelling: What an error calls its fields.
    """

    group: G
    spelling: Spelling

    def name(self, field: str) -> str:
        """What an error calls ``field`` (:meth:`Spelling.name`)."""
        return self.spelling.name(field)

    def said(self, field: str, value: Any) -> str:
        """``field=value`` as the user wrote it (:meth:`Spelling.said`)."""
        return self.spelling.said(field, value)

    def fail(self, message: str) -> NoReturn:
        """Raise the group's error with ``message``."""
        self.spelling.fail(message)


class Checked:
    """A frozen dataclass of options that checks its values when built (:meth:`check`,
    naming its fields ``Group.field``); :meth:`merged` builds it from the flat keywords
    of a public entry point instead, checked under their names."""

    KEYWORDS: ClassVar[dict[str, str]] = {}
    """field -> its flat keyword, where the two differ."""
    FLAT_VALUES: ClassVar[dict[str, dict[Any, Any]]] = {}
    """field -> {the field's value: the flat keyword's}, where the two differ."""
    ERROR: ClassVar[type[UnickptError]] = UnickptError

    def __post_init__(self) -> None:
        type(self).check(self, Spelling(type(self), flat=False))

    @classmethod
    def check(cls, v: Any, said: Spelling) -> None:
        """Raise ``said.fail(...)`` for a value of ``v`` (the group, or its values by
        field name) out of range, naming each field as ``said`` does."""

    @classmethod
    def from_keywords(cls: type[G], **flat: Any) -> G:
        """The group of a public entry point's flat keywords ``flat`` (by field name),
        checked under their names (:meth:`merged` without a group)."""
        return cls.merged(None, flat).group

    @classmethod
    def merged(cls: type[G], given: G | None, flat: dict[str, Any], defaults: dict[str, Any] | None = None) -> Given[G]:
        """What a public entry point was given: ``given`` (a group, or None) or the group
        of the flat keywords ``flat`` (by field name), checked under their names. One of
        the two ways, never both: a flat keyword off its default (the field's unless
        ``defaults`` says otherwise) beside a group is an error naming both.

        Raises:
            UnickptError: (the group's ``ERROR``) a bad value, or both ways given.
        """
        if given is None:
            values = {f.name: f.default for f in fields(cls) if f.default is not MISSING} | flat  # type: ignore[arg-type]
            spelling = Spelling(cls, flat=True)
            cls.check(SimpleNamespace(**values), spelling)
            return Given(cls(**flat), spelling)
        if not isinstance(given, cls):
            raise cls.ERROR(f"expected a {cls.__name__}, not {type(given).__name__} ({given!r})")
        defaults = {f.name: f.default for f in fields(cls)} | (defaults or {})  # type: ignore[arg-type]
        off = [cls.KEYWORDS.get(k, k) for k, v in flat.items() if v != defaults[k]]
        if off:
            raise cls.ERROR(f"{', '.join(off)} and a {cls.__name__} were both given: give one of the two")
        return Given(given, Spelling(cls, flat=False))


def at_least_one(v: Any, said: Spelling, field: str, optional: bool = False) -> None:
    """Fail unless ``v``'s ``field`` is a whole number >= 1 (or None, when ``optional``)."""
    value = getattr(v, field)
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        said.fail(f"{said.name(field)} must be a whole number >= 1{' or None' if optional else ''}, not {value!r}")


def flag(v: Any, said: Spelling, field: str) -> None:
    """Fail unless ``v``'s ``field`` is True or False."""
    value = getattr(v, field)
    if not isinstance(value, bool):
        said.fail(f"{said.name(field)} must be True or False, not {value!r}")


def whole(v: Any, said: Spelling, field: str) -> None:
    """Fail unless ``v``'s ``field`` is a whole number >= 0 (an interval, 0: never)."""
    value = getattr(v, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        said.fail(f"{said.name(field)} must be a whole number >= 0 (0: never), not {value!r}")


@dataclass(frozen=True)
class SaveOptions(Checked):
    """How a save writes each rank's file.

    Args:
        threads: Threads writing (and checksumming) this rank's file; at least 1.
        block_bytes: The checksum block (CRC32C per block): a positive multiple of 8.
        max_staging_bytes: For :func:`unickpt.async_save`: a cap on the host staging buffer
            (None: the whole shard at once); a larger shard is staged and written in batches.

    Raises:
        SaveError: A value out of range, naming it and what is allowed.
    """

    ERROR: ClassVar[type[UnickptError]] = SaveError

    threads: int = 4
    block_bytes: int = DEFAULT_BLOCK_BYTES
    max_staging_bytes: int | None = None

    @classmethod
    def check(cls, v: Any, said: Spelling) -> None:
        if not isinstance(v.threads, int) or v.threads < 1:
            said.fail(f"{said.name('threads')} must be a whole number >= 1, not {v.threads!r}")
        if not isinstance(v.block_bytes, int) or v.block_bytes <= 0 or v.block_bytes % 8:
            said.fail(f"{said.name('block_bytes')} must be a positive multiple of 8, not {v.block_bytes}")
        if v.max_staging_bytes is not None and v.max_staging_bytes <= 0:
            said.fail(f"{said.name('max_staging_bytes')} must be positive, not {v.max_staging_bytes}")
