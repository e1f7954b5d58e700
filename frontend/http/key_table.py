"""The API keys file (`--api-keys-file`): one entry per team, each with its own limits.

The file is YAML or JSON: a list of entries, or `{"keys": [...]}`. An entry is a `KeyEntry`
(unknown fields are errors, so a typo is not a silently missing limit). A secret is kept
only as its SHA-256 (`key` is hashed at load; `key_sha256` gives the hash itself), and a
presented key is hashed and compared with every entry's hash by `hmac.compare_digest`, so
neither the file in memory nor the time a lookup takes tells anything of the secrets.

`KeyTable` holds the live entries. `reload()` (SIGHUP, or `check_changed()` seeing a new
mtime or size) swaps in a new table only when the whole file is valid; a bad file keeps the
old table and logs why. The `--api-key` keys sit beside the file's as unlimited principals.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import logging
import os
from typing import Annotated

import msgspec
import yaml

from shared.param_ranges import INT64_MAX, INT64_MIN

log = logging.getLogger("sluice.frontend.keys")

Positive = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
# A name shows in logs and metric labels: short, and nothing a label or log line would mangle.
Name = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
Secret = Annotated[str, msgspec.Meta(min_length=16, max_length=512)]
Sha256 = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-fA-F]{64}$")]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]


class KeyEntry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One key. The limits left out are unlimited; `models` left out: every model."""

    name: Name
    key: Secret | None = None
    key_sha256: Sha256 | None = None
    requests_per_minute: Positive | None = None
    tokens_per_minute: Positive | None = None  # prompt + completion
    max_concurrent: Positive | None = None  # requests in flight at once, per frontend
    max_tokens_per_request: Positive | None = None
    priority: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] = 0
    models: Annotated[list[ModelName], msgspec.Meta(min_length=1)] | None = None
    expires: Annotated[dt.datetime, msgspec.Meta(tz=True)] | None = None


class Principal(msgspec.Struct, frozen=True):
    """Who a request is: a file entry, or (entry None) an unlimited --api-key key.
    `owner` is what owns the objects it stores: sha256(key)[:32], as for --api-key."""

    name: str
    digest: bytes
    entry: KeyEntry | None = None

    @property
    def owner(self) -> str:
        return self.digest.hex()[:32]

    def expired(self, now: float) -> bool:
        expires = self.entry.expires if self.entry else None
        return expires is not None and expires.timestamp() <= now


class KeysFileError(ValueError):
    pass


def _digest_of(entry: KeyEntry) -> bytes:
    if entry.key is not None:
        return hashlib.sha256(entry.key.encode()).digest()
    return bytes.fromhex(entry.key_sha256)


def _dated(raw):
    """YAML reads `expires: 2027-01-01` as a date: midnight UTC of it; a date-time without
    a zone stays zoneless, so the Struct refuses it (whose midnight would it be?)."""
    if isinstance(raw, dict) and type(raw.get("expires")) is dt.date:
        day = raw["expires"]
        raw = {**raw, "expires": dt.datetime(day.year, day.month, day.day, tzinfo=dt.UTC)}
    if isinstance(raw, dict) and isinstance(raw.get("expires"), dt.datetime):
        raw = {**raw, "expires": raw["expires"].isoformat()}
    return raw


def _entry(raw, number: int) -> KeyEntry:
    where = f"entry {number}"
    if isinstance(raw, dict) and isinstance(raw.get("name"), str):
        where += f" ({raw['name']!r})"
    try:
        entry = msgspec.convert(_dated(raw), KeyEntry)
    except msgspec.ValidationError as exc:
        raise KeysFileError(f"{where}: {exc}") from None
    if (entry.key is None) == (entry.key_sha256 is None):
        raise KeysFileError(f"{where}: give exactly one of `key` and `key_sha256`")
    if entry.models is not None and len(set(entry.models)) < len(entry.models):
        raise KeysFileError(f"{where}: `models` names a model twice")
    return entry


def parse_entries(text: str) -> list[KeyEntry]:
    """The entries of a keys file's text (YAML, of which JSON is a part)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KeysFileError(f"not YAML or JSON: {exc}") from None
    if isinstance(data, dict) and set(data) == {"keys"}:
        data = data["keys"]
    if not isinstance(data, list):
        raise KeysFileError("expected a list of entries, or {keys: [...]}")
    return [_entry(raw, number) for number, raw in enumerate(data, 1)]


def build_principals(entries: list[KeyEntry], plain_keys: list[str]) -> list[Principal]:
    """Entries and --api-key keys as principals; a repeated name or secret is an error."""
    principals = [Principal(f"api-key-{i}", hashlib.sha256(k.encode()).digest())
                  for i, k in enumerate(plain_keys, 1)]
    names: set[str] = set()
    digests = {p.digest for p in principals}
    for number, entry in enumerate(entries, 1):
        digest = _digest_of(entry)
        if entry.name in names:
            raise KeysFileError(f"entry {number} ({entry.name!r}): the name is taken by "
                                "an earlier entry")
        if digest in digests:
            raise KeysFileError(f"entry {number} ({entry.name!r}): the same key as an "
                                "earlier entry or an --api-key")
        names.add(entry.name)
        digests.add(digest)
        principals.append(Principal(entry.name, digest, entry))
    return principals


def _file_id(path: str) -> tuple[int, int]:
    status = os.stat(path)
    return status.st_mtime_ns, status.st_size


class KeyTable:
    """The live principals, and the file they came from."""

    def __init__(self, path: str | None, plain_keys: list[str]) -> None:
        self.path = path
        self.plain_keys = plain_keys
        self.principals = build_principals([], plain_keys)
        self._seen: tuple[int, int] | None = None
        if path is not None:
            self._load()  # a bad file at start raises, naming the entry

    def _load(self) -> None:
        seen = _file_id(self.path)
        with open(self.path, encoding="utf-8") as f:
            entries = parse_entries(f.read())
        self.principals = build_principals(entries, self.plain_keys)
        self._seen = seen

    def reload(self, why: str) -> bool:
        """Reads the file again; on any problem keeps the table it has and says why."""
        try:
            self._load()
        except (OSError, KeysFileError) as exc:
            log.error("--api-keys-file %s (%s): not reloaded, keeping the %d keys in use: %s",
                      self.path, why, len(self.principals), exc)
            return False
        log.info("--api-keys-file %s reloaded (%s): %d keys", self.path, why,
                 len(self.principals))
        return True

    def check_changed(self) -> None:
        """Reloads when the file's mtime or size moved since the last load."""
        try:
            changed = self.path is not None and _file_id(self.path) != self._seen
        except OSError:
            changed = False  # gone for a moment (an editor's rename): keep what we have
        if changed:
            self.reload("the file changed")

    def by_owner(self, owner: str | None) -> Principal | None:
        """The principal whose stored objects `owner` marks (a batch's key)."""
        return next((p for p in self.principals if owner and p.owner == owner), None)

    def lookup(self, presented: bytes) -> Principal | None:
        """The principal whose key this is. Every hash is compared, match or not, each in
        constant time, so the time taken says nothing of which entry (if any) matched."""
        digest = hashlib.sha256(presented).digest()
        found = None
        for principal in self.principals:
            if hmac.compare_digest(digest, principal.digest):
                found = principal
        return found


def presented_keys(scope) -> list[bytes]:
    """The keys a request presents: `Authorization: Bearer KEY` (OpenAI clients) and
    `x-api-key: KEY` (Anthropic clients)."""
    keys = []
    for name, value in scope["headers"]:
        if name == b"authorization" and value[:7].lower() == b"bearer ":
            keys.append(value[7:].strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys

