"""The fast suite's budget list (`tests/fast_suite.py`) names tests that exist, and moving them keeps a
real check of their file in the fast suite."""
import pathlib
import re

from tests.fast_suite import MOVED

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_moved_test_exists():
  for nodeid in MOVED:
    path, name = nodeid.split("::")
    assert (ROOT / path).exists(), nodeid
    assert re.search(rf"^def {re.escape(name.split('[')[0])}\(", (ROOT / path).read_text(), re.M), nodeid


def test_every_file_keeps_a_test_in_the_fast_suite():
  """A file whose every test moved would leave its feature unchecked by the fast suite."""
  for path in {n.split("::")[0] for n in MOVED}:
    text = (ROOT / path).read_text()
    tests = re.findall(r"^((?:@pytest\.mark\.\w+.*\n)*)def (test_\w+)\(", text, re.M)
    moved = {n.split("::")[1].split("[")[0] for n in MOVED if n.startswith(path + "::")}
    kept = [name for marks, name in tests if "mark.slow" not in marks and name not in moved]
    parametrized_partly = any(n.split("::")[0] == path and "[" in n for n in MOVED)
    assert kept or parametrized_partly, f"every fast test of {path} moved to the full suite"
