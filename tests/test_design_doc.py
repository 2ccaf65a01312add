"""docs/DESIGN.md exists and every section the code cites by name is one of its headings."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_cited_section_of_the_design_is_a_heading():
  headings = {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", (ROOT / "docs" / "DESIGN.md").read_text(), re.M)}
  cited = []
  for path in sorted(ROOT.glob("zerojax/**/*.py")) + sorted(p for p in ROOT.glob("tests/*.py") if p.name != "test_design_doc.py"):
    text = re.sub(r"\s+", " ", path.read_text())
    cited += [(path.name, m.group(1)) for m in re.finditer(r'docs/DESIGN\.md,? "([^"]+)"', text)]
    assert not re.search(r"(?<!docs/)DESIGN\.md", text), f"{path} cites DESIGN.md without its folder (docs/)"
  assert len(cited) >= 8
  assert [c for c in cited if c[1] not in headings] == []


def format_block() -> str:
  """The `BlockFloat8` class as `zerojax/comm/formats.py` holds it (what the design shows)."""
  src = (ROOT / "zerojax" / "comm" / "formats.py").read_text()
  start = src.index("@dataclasses.dataclass(frozen=True)\nclass BlockFloat8(")
  return src[start:src.index("\n\n\n", start)] + "\n"


def test_the_design_shows_the_float8_format_as_the_tree_holds_it():
  """The "Wire formats" section's code block is the float8 format's class, verbatim: adding a format is
  that much (`python -m tests.test_design_doc` rewrites the block from the tree)."""
  text = (ROOT / "docs" / "DESIGN.md").read_text()
  section = text[text.index("## Wire formats"):text.index("## qgZ step by step")]
  shown = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert shown == format_block()


def toy_block() -> str:
  """The `ToySync` class as `tests/toy_sync.py` holds it (the worked example of a stateful technique)."""
  src = (ROOT / "tests" / "toy_sync.py").read_text()
  return src[src.index("@dataclasses.dataclass(frozen=True)\nclass ToySync("):]


def test_the_design_shows_the_toy_stateful_technique_as_the_tree_holds_it():
  text = (ROOT / "docs" / "DESIGN.md").read_text()
  section = text[text.index("### Adding a stateful technique"):text.index("## Known debts")]
  shown = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  assert shown == toy_block()


if __name__ == "__main__":
  doc = ROOT / "docs" / "DESIGN.md"
  text = doc.read_text()
  for heading, block in (("## Wire formats", format_block()), ("### Adding a stateful technique", toy_block())):
    head = text.index("```python\n", text.index(heading)) + len("```python\n")
    text = text[:head] + block + text[text.index("```", head):]
  doc.write_text(text)
