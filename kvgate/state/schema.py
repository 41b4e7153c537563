"""How records in the state store change between releases without stopping a rolling upgrade.

During an upgrade, gateways and autoscalers of two releases read each other's records. Every record that
crosses the store (`MemberRecord` in `base`, the records in `records`, and the node claims of
`autoscaler.claims`, which hold a providers value and so live there) follows the same rules:

- Its JSON carries `"schema_version"`, a major version: 1 today. A record without it was written before the
  field existed, and reads as version 1.
- Adding an optional field keeps the major: a reader ignores fields it does not know, and gives a field it
  knows but does not find its default. Removing or renaming a field, or changing its type or meaning, is a
  new major.
- A reader that meets a major it does not know raises `NewerSchema` (a ValueError) from `from_json`; the
  polling reader skips that record and says so once, through its `SkippedRecords`, rather than crash or
  log it on every poll.

(`schema_version` is the shape of the data; `StoredRecord.version` is the store's write counter.)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

SCHEMA_KEY = "schema_version"


class NewerSchema(ValueError):
    """A record written by a newer release, in a major schema version this release cannot read."""

    def __init__(self, what: str, found: int, known: int) -> None:
        self.what = what
        self.found = found
        self.known = known
        super().__init__(f"{what} record has schema_version {found}, newer than the {known} this release "
                         "reads: written by a newer kvgate; skipped until this process is upgraded")


def check_schema(raw: Mapping[str, Any], what: str, known: int) -> None:
    """Raise `NewerSchema` when `raw` is of a major newer than `known`, ValueError when its version is not
    a positive int; an absent version is 1 (written before versions were)."""
    found = raw.get(SCHEMA_KEY, 1)
    if isinstance(found, bool) or not isinstance(found, int) or found < 1:
        raise ValueError(f"{what} record: {SCHEMA_KEY} must be an int >= 1, got {found!r}")
    if found > known:
        raise NewerSchema(what, found, known)


class SkippedRecords:
    """One reader's memory of the newer records it skipped, so that its log says so once per record and
    version, not on every poll (the autoscaler reads every tick, the dashboard every sample). Not shared:
    each reader keeps its own."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._said: set[tuple[str, str, int]] = set()

    def newer(self, collection: str, record_id: str, exc: NewerSchema) -> None:
        """Log (once) that the record `collection`/`record_id` was skipped for `exc`."""
        key = (collection, record_id, exc.found)
        if key in self._said:
            return
        self._said.add(key)
        self._logger.warning("skipping state store record %s/%s: %s", collection, record_id, exc)


def non_negative(raw: Any, what: str) -> float:
    """`raw` as a float when it is a finite number >= 0 (not a bool), else ValueError."""
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {raw!r}")
    return float(raw)


def count(raw: Any, what: str) -> int:
    """`raw` as an int when it is a finite number >= 0 (not a bool), else ValueError."""
    return int(non_negative(raw, what))
