"""How one save writes (:class:`SaveOptions`), checked once, in one place, for every writer:
``unickpt.save``, ``unickpt.async_save`` and the DCP storage writer.

The option groups share one way of naming a bad value (:class:`Checked`): a group built
from the flat keywords users write (``save(..., block_bytes=12)``) names the keyword, one
written as a group (``SaveOptions(block_bytes=12)``) names the group's field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from ..errors import SaveError, UnickptError
from ..format.manifest import DEFAULT_BLOCK_BYTES

__all__ = ["Checked", "SaveOptions"]


class Checked:
    """A frozen dataclass of options that checks itself in ``__post_init__``; its errors
    name the flat keyword of a field (``KEYWORDS``) when built by :meth:`from_keywords`,
    else ``Class.field``."""

    KEYWORDS: ClassVar[dict[str, str]] = {}
    ERROR: ClassVar[type[UnickptError]] = UnickptError

    @classmethod
    def from_keywords(cls, **values: Any) -> Any:
        """The group of the flat keywords ``values`` (by field name); its errors name them."""
        obj = cls.__new__(cls)
        object.__setattr__(obj, "_flat", True)
        obj.__init__(**values)  # type: ignore[misc]
        return obj

    @classmethod
    def merged(cls, given: Any, flat: dict[str, Any], defaults: dict[str, Any] | None = None) -> Any:
        """``given`` (a group, or None) or the group of the flat keywords ``flat`` (by field
        name): one of the two ways, never both (a flat keyword off its default, the field's
        unless ``defaults`` says otherwise, beside a group is an error naming both)."""
        if given is None:
            return cls.from_keywords(**flat)
        if not isinstance(given, cls):
            raise cls.ERROR(f"expected a {cls.__name__}, not {type(given).__name__} ({given!r})")
        defaults = {f.name: f.default for f in fields(cls)} | (defaults or {})  # type: ignore[arg-type]
        off = [cls.KEYWORDS.get(k, k) for k, v in flat.items() if v != defaults[k]]
        if off:
            raise cls.ERROR(f"{', '.join(off)} and a {cls.__name__} were both given: give one of the two")
        return given

    def name(self, field: str) -> str:
        """What an error calls ``field``: the flat keyword or ``Class.field``."""
        if getattr(self, "_flat", False):
            return self.KEYWORDS.get(field, field)
        return f"{type(self).__name__}.{field}"

    def fail(self, message: str) -> None:
        """Raise this group's error (a :class:`~unickpt.UnickptError`) with ``message``."""
        raise self.ERROR(message)


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

    def __post_init__(self) -> None:
        if not isinstance(self.threads, int) or self.threads < 1:
            self.fail(f"{self.name('threads')} must be a whole number >= 1, not {self.threads!r}")
        if not isinstance(self.block_bytes, int) or self.block_bytes <= 0 or self.block_bytes % 8:
            self.fail(f"{self.name('block_bytes')} must be a positive multiple of 8, not {self.block_bytes}")
        if self.max_staging_bytes is not None and self.max_staging_bytes <= 0:
            self.fail(f"{self.name('max_staging_bytes')} must be positive, not {self.max_staging_bytes}")
