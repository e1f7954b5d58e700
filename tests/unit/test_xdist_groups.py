"""`make test`'s xdist scheduling (tests/conftest.py): a file's tests stay on one worker, and
the files that share a session server other than the shared engine stay on one worker too,
so each server starts once per run rather than once per worker."""

from tests.conftest import XDIST_GROUPS, FileGroupScheduling

scope = FileGroupScheduling._split_scope


def test_a_file_is_one_unit():
    a = "tests/integration/test_spine.py"
    assert scope(f"{a}::test_one") == scope(f"{a}::test_two[x::y]") == a
    assert scope(f"{a}::Class::test_three") == a
    assert scope("tests/unit/test_codec.py::test_one") != a


def test_files_sharing_a_session_server_are_one_unit():
    by_group: dict[str, set[str]] = {}
    for name, group in XDIST_GROUPS.items():
        folder = "unit" if name == "test_weights.py" else "integration"
        by_group.setdefault(group, set()).add(scope(f"tests/{folder}/{name}::test_x[a-b]"))
    assert {group: len(units) for group, units in by_group.items()} == {"cluster": 1, "fuzz": 1}
    fuzz, cluster = "tests/integration/test_fuzz.py", "tests/integration/test_reference.py"
    assert scope(f"{fuzz}::t") != scope(f"{cluster}::t")
