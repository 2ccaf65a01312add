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
