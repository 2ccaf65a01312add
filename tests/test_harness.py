"""The test harness itself (`tests/conftest.py`): a test whose xdist worker crashes in native code runs once
more on a fresh worker and a second crash fails it; each module's compiled programs are released at its
end. A pytest run in a subprocess, on test files written to a temporary directory."""
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CRASHING = """
import os, signal

def test_crashes_once():
  flag = os.path.join(os.environ["CRASH_FLAG_DIR"], "crashed")
  if not os.path.exists(flag):
    open(flag, "w").close()
    os.kill(os.getpid(), signal.SIGSEGV)

def test_crashes_always():
  os.kill(os.getpid(), signal.SIGSEGV)

def test_passes():
  pass
"""

RELEASING = """
import functools

import jax
import jax.numpy as jnp

_cache = {}

@functools.cache
def compiled():
  return jax.jit(lambda x: x + 1).lower(jnp.zeros(3)).compile()

def test_fills_the_caches():
  _cache["program"] = compiled()
  assert compiled.cache_info().currsize == 1

def test_fills_them_again():
  assert _cache and compiled.cache_info().currsize == 1
"""

CHECKING = """
import test_releasing

def test_the_other_module_released_its_caches():
  assert test_releasing._cache == {}
  assert test_releasing.compiled.cache_info().currsize == 0
"""


def _pytest(tmp_path, files: dict, *args) -> subprocess.CompletedProcess:
  for name, text in files.items():
    (tmp_path / name).write_text(textwrap.dedent(text))
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)]), "CRASH_FLAG_DIR": str(tmp_path),
         "ZEROJAX_TEST_CACHE": "0"}
  return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                         "--rootdir", str(tmp_path), *args, *files], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_crashed_test_runs_once_more_and_a_second_crash_fails_it(tmp_path):
  run = _pytest(tmp_path, {"test_crashing.py": CRASHING}, "-n", "2")
  out = run.stdout
  assert run.returncode == 1, out
  assert all(part in out for part in ("1 failed", "2 passed", "2 rerun")), out
  assert "tests whose worker crashed" in out, out
  assert "test_crashing.py::test_crashes_once: 1 crash\n" in out, out
  assert "test_crashing.py::test_crashes_always: 2 crashes (failed)" in out, out


def test_each_module_releases_its_compiled_programs_at_its_end(tmp_path):
  run = _pytest(tmp_path, {"test_releasing.py": RELEASING, "test_zchecking.py": CHECKING}, "-n", "0")
  assert run.returncode == 0, run.stdout + run.stderr
  assert "3 passed" in run.stdout, run.stdout
