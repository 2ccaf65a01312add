"""The package layout holds: each folder is one layer of the design and imports only downward.

Layers (docs/DESIGN.md, "Layers"), lowest first; a module may import modules of a lower
layer, or of its own group (folder, or the core modules among themselves), never upward or sideways:

  0  pallas_kernels                                       the GPU kernels
  1  zerojax.mesh | zerojax.{quantization, kernel_choice} | zerojax.gpu_aot  the mesh | the kernels' front | compile-only GPUs
  2  zerojax.comm                                         the collectives
  3  zerojax.{plan_values, plan_checks, plan_radius, plan, components, layout, remat, fidelity, unit, prefetch, scan_layers, executor,
     state_views, step, memory, logical, stateful, radius_sync, train_state, jaxpr_walk}      core: the plan, its components and the one executor
  4  zerojax.models | zerojax.planner                     models | the AMSP planner
  5  zerojax.train | zerojax.analysis                     trainer | reading compiled programs
  6  zerojax.cli                                          commands
  7  zerojax (the package's __init__)                     the public API, re-exported
"""
from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ("plan_values", "plan_checks", "plan_radius", "plan", "components", "layout", "remat", "fidelity", "unit", "prefetch", "scan_layers",
        "executor", "state_views", "step",
        "memory", "logical", "model", "stateful", "radius_sync", "train_state", "jaxpr_walk", "offload", "plan_outer",
        "outer_sync")
MAX_LINES = 500
MAX_ENGINE_LINES = 350  # zerojax/*.py: one concern each


def group_of(module: str) -> tuple[int, str]:
  """(layer, group) of a module; modules of one group may import each other (without cycles)."""
  parts = module.split(".")
  if parts[0] == "pallas_kernels":
    return 0, "pallas_kernels"
  if module == "zerojax":
    return 7, "api"
  top = parts[1]
  if top in ("quantization", "kernel_choice"):
    return 1, "quantization"
  if top in ("mesh", "gpu_aot"):
    return 1, top
  if top == "comm":
    return 2, "comm"
  if top in CORE:
    return 3, "core"
  if top in ("models", "planner"):
    return 4, top
  if top in ("train", "analysis"):
    return 5, top
  if top == "cli":
    return 6, "cli"
  raise AssertionError(f"module {module} is in no layer; add it to tests/test_import_graph.py's layers")


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


def test_nothing_in_the_library_imports_analysis():
  edges = graph()
  users = sorted(m for m, ds in edges.items() for d in ds
                 if d.startswith("zerojax.analysis") and not m.startswith(("zerojax.analysis", "zerojax.cli")))
  assert users == []


@pytest.mark.parametrize("edges,expect", [
    ({"zerojax.comm.gather": {"zerojax.executor"}, "zerojax.executor": set()}, "imports zerojax.executor"),
    ({"zerojax.train.trainer": {"zerojax.analysis.report"}, "zerojax.analysis.report": set()}, "layer 5, analysis"),
    ({"zerojax.unit": {"zerojax.executor"}, "zerojax.executor": {"zerojax.unit"}}, "cycle"),
    ({"zerojax.comm.qgz": {"zerojax.comm"}, "zerojax.comm": set()}, "its own package"),
])
def test_the_check_catches_bad_edges(edges, expect):
  found = violations(edges)
  assert any(expect in v for v in found), found


def test_design_layer_table_names_the_core_modules():
  """The "Layers" table of docs/DESIGN.md lists, in its core row, exactly the core modules this test checks."""
  text = (ROOT / "docs/DESIGN.md").read_text()
  row = next(line for line in text.splitlines() if line.startswith("| 3 | core:"))
  listed = set(re.findall(r"`(\w+)`", row.split("|")[2]))
  assert listed == set(CORE), f"DESIGN lists {sorted(listed ^ set(CORE))} differently from CORE"
  on_disk = {p.stem for p in (ROOT / "zerojax").glob("*.py")} - {"__init__", "mesh", "quantization", "kernel_choice", "gpu_aot"}
  assert on_disk == set(CORE), f"core modules on disk and in CORE differ: {sorted(on_disk ^ set(CORE))}"


def test_engine_modules_are_short():
  long = [f"{p.name}: {n} lines" for p in (ROOT / "zerojax").glob("*.py")
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
  assert "zerojax/unit.py" in sources and "tests/helpers.py" in sources
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
