"""The API keys file (`frontend.http.key_table`): every entry field's boundaries, the
duplicates, the hashing and the timing-safe lookup, and reloads that keep the old table."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os

import pytest

from frontend.http import key_table
from frontend.http.key_table import KeysFileError, KeyTable, build_principals, parse_entries

SECRET = "sk-team-a-0123456789"
OTHER = "sk-team-b-0123456789"


def entries(*items: dict) -> list:
    return parse_entries(json.dumps(list(items)))


def one(**fields) -> key_table.KeyEntry:
    return entries({"name": "team-a", "key": SECRET, **fields})[0]


def refused(match: str, *items: dict) -> None:
    with pytest.raises(KeysFileError, match=match):
        build_principals(entries(*items), [])


def test_a_full_entry_reads_from_yaml_with_its_date():
    [entry] = parse_entries(f"""
keys:
  - name: team-a
    key: {SECRET}
    requests_per_minute: 3
    tokens_per_minute: 1000
    max_concurrent: 2
    max_tokens_per_request: 64
    priority: -5
    models: [SmolLM2-135M-Instruct, my-adapter]
    expires: 2027-01-01
""")
    assert entry.requests_per_minute == 3 and entry.priority == -5
    assert entry.models == ["SmolLM2-135M-Instruct", "my-adapter"]
    assert entry.expires.isoformat() == "2027-01-01T00:00:00+00:00"


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute",
                                   "max_concurrent", "max_tokens_per_request"])
def test_every_limit_is_a_positive_integer(field):
    assert getattr(one(**{field: 1}), field) == 1
    assert getattr(one(**{field: 2**53}), field) == 2**53
    for bad in (0, -1, 2**53 + 1, 1.5, "3", True):
        with pytest.raises(KeysFileError, match=f"entry 1 \\('team-a'\\).*{field}"):
            one(**{field: bad})


def test_priority_is_a_signed_64_bit_integer():
    assert one(priority=-(2**63)).priority == -(2**63)
    assert one(priority=2**63 - 1).priority == 2**63 - 1
    for bad in (2**63, -(2**63) - 1, "high", 1.0, True):
        with pytest.raises(KeysFileError, match="priority"):
            one(priority=bad)


def test_names_keys_and_models_are_bounded():
    assert one(name="a").name == "a" and one(name="a" * 64).name == "a" * 64
    for bad in ("", "a" * 65, "-lead", "with space", "x:y", 'q"', 3):
        with pytest.raises(KeysFileError, match="name"):
            one(name=bad)
    assert one(key="k" * 16).key == "k" * 16
    for bad in ("k" * 15, "k" * 513, 123):
        with pytest.raises(KeysFileError, match="key"):
            one(key=bad)
    for bad in ([], [""], "one-model", [3]):
        with pytest.raises(KeysFileError, match="models"):
            one(models=bad)
    with pytest.raises(KeysFileError, match="names a model twice"):
        one(models=["m", "m"])


def test_exactly_one_of_key_and_its_hash():
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    by_hash = entries({"name": "team-a", "key_sha256": digest.upper()})[0]
    [principal] = build_principals([by_hash], [])
    assert principal.digest.hex() == digest
    for bad in ("ab" * 31, "zz" * 32, "ab" * 33):
        with pytest.raises(KeysFileError, match="key_sha256"):
            entries({"name": "team-a", "key_sha256": bad})
    with pytest.raises(KeysFileError, match="exactly one"):
        entries({"name": "team-a"})
    with pytest.raises(KeysFileError, match="exactly one"):
        entries({"name": "team-a", "key": SECRET, "key_sha256": digest})


def test_expires_needs_a_zone_or_is_a_date():
    assert one(expires="2027-01-01T12:00:00+02:00").expires.utcoffset().seconds == 7200
    with pytest.raises(KeysFileError, match="timezone"):
        one(expires="2027-01-01T12:00:00")
    for bad in ("soon", 1700000000, "2027-13-01T00:00:00Z"):
        with pytest.raises(KeysFileError, match="expires"):
            one(expires=bad)
    [p] = build_principals([one(expires="2027-01-01T00:00:00Z")], [])
    assert not p.expired(1798761599.0) and p.expired(1798761600.0)


def test_unknown_fields_shapes_and_duplicates_are_errors_naming_the_entry():
    with pytest.raises(KeysFileError, match="entry 1 \\('team-a'\\).*unknown field `rpm`"):
        one(rpm=3)
    for text in ("{name: a}", "3", "keys: 3", "[1, 2]", "{keys: [], more: 1}", "[: bad"):
        with pytest.raises(KeysFileError):
            parse_entries(text)
    assert parse_entries("[]") == [] and parse_entries("keys: []") == []
    refused("entry 2 \\('team-a'\\): the name is taken",
            {"name": "team-a", "key": SECRET}, {"name": "team-a", "key": OTHER})
    refused("entry 2 \\('team-b'\\): the same key",
            {"name": "team-a", "key": SECRET},
            {"name": "team-b", "key_sha256": hashlib.sha256(SECRET.encode()).hexdigest()})
    with pytest.raises(KeysFileError, match="an --api-key"):
        build_principals(entries({"name": "team-a", "key": SECRET}), [SECRET])


def test_lookup_hashes_and_compares_every_entry_in_constant_time(monkeypatch):
    principals_file = entries({"name": "team-a", "key": SECRET}, {"name": "team-b", "key": OTHER})
    table = KeyTable(None, ["plain-key-0123456789"])
    table.principals = build_principals(principals_file, ["plain-key-0123456789"])
    # The table keeps hashes only: no secret is in it.
    assert all(SECRET.encode() not in p.digest for p in table.principals)
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(key_table.hmac, "compare_digest", counting)
    assert table.lookup(SECRET.encode()).name == "team-a"
    assert len(calls) == 3  # a match on entry 1 still compares with every entry
    assert all(a == hashlib.sha256(SECRET.encode()).digest() for a, _ in calls)
    assert table.lookup(b"plain-key-0123456789").entry is None  # --api-key: unlimited
    assert table.lookup(b"sk-nobody-0123456789") is None
    assert table.lookup(SECRET.encode()[:-1]) is None
    assert table.lookup(SECRET.encode()).owner == hashlib.sha256(SECRET.encode()).hexdigest()[:32]


def test_a_bad_reload_keeps_the_old_table_and_says_why(tmp_path, caplog):
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps([{"name": "team-a", "key": SECRET}]))
    table = KeyTable(str(path), [])
    path.write_text(json.dumps([{"name": "team-a", "key": SECRET, "max_concurrent": 0}]))
    with caplog.at_level(logging.ERROR, "sluice.frontend.keys"):
        assert not table.reload("SIGHUP")
    assert "max_concurrent" in caplog.text and "keeping the 1 keys" in caplog.text
    assert table.lookup(SECRET.encode()).name == "team-a"
    path.unlink()
    assert not table.reload("SIGHUP") and table.lookup(SECRET.encode()) is not None
    table.check_changed()  # a file gone for a moment is no change
    path.write_text(json.dumps([{"name": "team-b", "key": OTHER}]))
    table.check_changed()
    assert table.lookup(SECRET.encode()) is None and table.lookup(OTHER.encode()).name == "team-b"
    seen = os.stat(path).st_mtime_ns
    table.check_changed()  # nothing moved: nothing read
    assert os.stat(path).st_mtime_ns == seen


def test_a_bad_file_at_start_is_one_line_naming_the_entry(tmp_path):
    from frontend.http.key_flags import _keys_file

    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"name": "ok", "key": SECRET},
                                {"name": "team-b", "key": OTHER, "priority": "high"}]))
    with pytest.raises(Exception, match="entry 2 \\('team-b'\\).*priority") as info:
        _keys_file(str(path))
    assert "\n" not in str(info.value)
    with pytest.raises(Exception, match="No such file"):
        _keys_file(str(tmp_path / "missing.yaml"))
