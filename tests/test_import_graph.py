"""The package layout holds: each folder is one layer of the design and imports only downward.

The layers are the one table in docs/DESIGN.md ("Layers"), read here: each row is a layer (lowest first)
and names its groups (`zerojax.comm`, `zerojax.engine`, ...); a module belongs to the group whose name is
the longest prefix of its own. A module may import modules of a lower layer, or of its own group, never
upward or sideways; every module of the tree is in a group.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 500
MAX_ENGINE_LINES = 400  # the library's folders below the models: one job per module
ENGINE = ("plan", "engine", "state", "executor", "quant", "comm")


def layers() -> dict[str, int]:
  """`{group: layer}` from docs/DESIGN.md's "Layers" table."""
  text = (ROOT / "docs/DESIGN.md").read_text()
  section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
  out = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) >= 3 and cells[0].isdigit():
      for group in re.findall(r"`([\w.]+)`", cells[1]):
        out[group] = int(cells[0])
  return out


LAYERS = layers()


def group_of(module: str) -> tuple[int, str]:
  """(layer, group) of a module; modules of one group may import each other (without cycles)."""
  parts = module.split(".")
  for n in range(len(parts), 0, -1):
    group = ".".join(parts[:n])
    if group in LAYERS and (group != "zerojax" or module == "zerojax"):  # the package's __init__: the API
      return LAYERS[group], group
  raise AssertionError(f"module {module} is in no layer; add its folder to docs/DESIGN.md's \"Layers\" table")


def modules() -> dict[str, pathlib.Path]:
  out = {}
  for pkg in ("zerojax", "pallas_kernels"):
    for path in (ROOT / pkg).rglob("*.py"):
      rel = path.relative_to(ROOT).with_suffix("")
      parts = list(rel.parts)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def imports(path: pathlib.Path, known: set[str]) -> set[str]:
  """Project modules `path` imports (anywhere in the file, functions included)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        found.add(sub if sub in known else node.module)
  return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
  mods = modules()
  known = set(mods)
  return {m: imports(p, known) - {m} for m, p in mods.items()}


def violations(edges: dict[str, set[str]]) -> list[str]:
  """Upward or sideways edges, and cycles, of an import graph."""
  bad = []
  for src, dsts in edges.items():
    ls, gs = group_of(src)
    for dst in dsts:
      ld, gd = group_of(dst)
      if src.startswith(dst + "."):  # a package's own __init__ (e.g. zerojax.comm for zerojax.comm.qgz)
        bad.append(f"{src} imports its own package {dst}: import the module it needs")
      elif ld > ls or (ld == ls and gd != gs):
        bad.append(f"{src} (layer {ls}, {gs}) imports {dst} (layer {ld}, {gd})")
  state: dict[str, int] = {}

  def visit(m, stack):
    state[m] = 1
    for d in sorted(edges.get(m, ())):
      if state.get(d) == 1:
        bad.append("cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
      elif d not in state:
        visit(d, stack + [d])
    state[m] = 2

  for m in sorted(edges):
    if m not in state:
      visit(m, [m])
  return bad


def test_import_graph_has_no_upward_edge_and_no_cycle():
  edges = graph()
  assert "zerojax.comm.qgz" in edges and "zerojax.analysis.collectives" in edges  # the walk found the tree
  assert violations(edges) == []


def test_in_the_library_only_remat_auto_imports_analysis():
  """Reading compiled programs is for the tools (cli) and for remat "auto", which prices each mode's
  compiled step (`zerojax.planner.remat`); nothing else in the library depends on it."""
  edges = graph()
  users = sorted({m for m, ds in edges.items() for d in ds
                  if d.startswith("zerojax.analysis") and not m.startswith(("zerojax.analysis", "zerojax.cli"))})
  assert users == ["zerojax.planner.remat"]


@pytest.mark.parametrize("edges,expect", [
    ({"zerojax.comm.gather": {"zerojax.executor"}, "zerojax.executor": set()}, "imports zerojax.executor"),
    ({"zerojax.executor.step": {"zerojax.analysis.report"}, "zerojax.analysis.report": set()}, f"layer {LAYERS['zerojax.analysis']}, zerojax.analysis"),
    ({"zerojax.engine.unit": {"zerojax.executor"}, "zerojax.executor": {"zerojax.engine.unit"}}, "cycle"),
    ({"zerojax.comm.qgz": {"zerojax.comm"}, "zerojax.comm": set()}, "its own package"),
])
def test_the_check_catches_bad_edges(edges, expect):
  found = violations(edges)
  assert any(expect in v for v in found), found


def test_the_layer_table_names_every_folder_and_every_module_is_in_a_layer():
  """docs/DESIGN.md's table is the only one: every package of the tree is a group of it, no flat module is
  left beside the folders but the layer-1 ones it names, and each module falls in a group."""
  assert LAYERS["zerojax"] > LAYERS["zerojax.cli"] > LAYERS["zerojax.executor"] > LAYERS["zerojax.state"] > \
      LAYERS["zerojax.engine"] > LAYERS["zerojax.plan"] > LAYERS["zerojax.comm"] > LAYERS["pallas_kernels"]
  packages = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "zerojax").rglob("__init__.py")}
  assert packages - {"zerojax"} <= set(LAYERS), sorted(packages - set(LAYERS))
  flat = {f"zerojax.{p.stem}" for p in (ROOT / "zerojax").glob("*.py")} - {"zerojax.__init__"}
  assert flat <= set(LAYERS), sorted(flat - set(LAYERS))
  for m in modules():
    group_of(m)


def test_engine_modules_are_short():
  long = [f"{p.relative_to(ROOT)}: {n} lines" for d in ENGINE for p in (ROOT / "zerojax" / d).glob("*.py")
          if (n := len(p.read_text().splitlines())) > MAX_ENGINE_LINES]
  assert long == [], f"engine modules over {MAX_ENGINE_LINES} lines: {long}"


def test_files_are_short():
  long = [f"{p.relative_to(ROOT)}: {n} lines" for p in list(modules().values()) + list((ROOT / "tests").glob("*.py"))
          + list((ROOT / "benchmarks").glob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_LINES]
  assert long == [], f"files over {MAX_LINES} lines: {long}"
  assert os.path.exists(ROOT / "train.py")


# -- private names stay in their module --------------------------------------------------------------

def is_private(name: str) -> bool:
  return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def project_files() -> list[pathlib.Path]:
  """Every Python file of the library, the kernels, the benchmarks, the examples and the tests."""
  dirs = ("zerojax", "pallas_kernels", "benchmarks", "examples", "tests")
  return sorted(p for d in dirs for p in (ROOT / d).rglob("*.py")) + [ROOT / "train.py"]


def private_definitions(tree: ast.AST) -> set[str]:
  """Private names a file defines: functions, classes, variables, attributes it assigns, parameters."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
      names.add(node.id if isinstance(node, ast.Name) else node.attr)
    elif isinstance(node, ast.arg):
      names.add(node.arg)
  return {n for n in names if is_private(n)}


def private_uses(sources: dict[str, str]) -> list[str]:
  """`file:line: use` for every private name a file takes from another project file: `from m import _x`
  of a project module, or `obj._x` (obj not self/cls) where `_x` is defined in another file only."""
  trees = {f: ast.parse(s) for f, s in sources.items()}
  defined = {f: private_definitions(t) for f, t in trees.items()}
  anywhere = set().union(*defined.values()) if defined else set()
  project = ("zerojax", "pallas_kernels", "benchmarks", "tests")
  bad = []
  for f, tree in trees.items():
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in project:
        bad += [f"{f}:{node.lineno}: from {node.module} import {a.name}" for a in node.names if is_private(a.name)]
      elif (isinstance(node, ast.Attribute) and is_private(node.attr) and node.attr in anywhere
            and node.attr not in defined[f] and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
        bad.append(f"{f}:{node.lineno}: {ast.unparse(node)}")
  return bad


def test_no_module_uses_another_modules_private_names():
  sources = {str(p.relative_to(ROOT)): p.read_text() for p in project_files()}
  assert "zerojax/engine/unit.py" in sources and "tests/helpers.py" in sources
  assert private_uses(sources) == []


def test_test_files_share_helpers_through_helper_modules():
  """A test file imports no other test file: shared helpers live in tests/helpers.py (and the like)."""
  bad = []
  for p in project_files():
    for node in ast.walk(ast.parse(p.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [f"{node.module}.{a.name}" for a in node.names] if isinstance(node, ast.ImportFrom) and node.module
               else [])
      bad += [f"{p.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.startswith("tests.test_")]
  assert bad == []


@pytest.mark.parametrize("sources,expect", [
    ({"a.py": "def _f(): pass", "b.py": "from zerojax.a import _f"}, "b.py:1: from zerojax.a import _f"),
    ({"a.py": "class E:\n  def _g(self): pass", "b.py": "def h(e):\n  return e._g()"}, "b.py:2: e._g"),
])
def test_the_private_check_catches_cross_module_uses(sources, expect):
  assert expect in private_uses(sources)


def test_the_private_check_allows_own_private_names():
  assert private_uses({"a.py": "class E:\n  def _g(self): pass\n  def h(self, o):\n    return self._g(), o._g()"}) == []
