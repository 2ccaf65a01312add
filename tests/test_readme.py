"""The README and the pages under docs/: their python examples run as written, and the README is a short
page whose links to docs/ lead somewhere."""
import pathlib
import re

import numpy as np
import pytest

from tests.doc_sections import code_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_api_example_runs():
  code = [c for c in code_blocks("The API", "api.md") if "zerojax.Model(" in c][0]
  scope = {}
  exec(compile(code, "docs/api.md", "exec"), scope)
  assert int(scope["state"].step) == 1 and np.isfinite(float(scope["metrics"].loss))
  assert scope["params"]["layers"]["w"].shape == (4, 64, 64)


def test_readme_flax_example_runs():
  code = [c for c in code_blocks("Your own flax model", "flax.md") if "zerojax.from_linen" in c][0]
  scope = {}
  exec(compile(code, "docs/flax.md", "exec"), scope)
  assert int(scope["state"].step) == 1 and np.isfinite(float(scope["metrics"].loss))
  assert scope["params"]["Block_0"]["Dense_0"]["kernel"].shape == (32, 32)
  assert set(scope["stats"]) == {"Block_0", "Block_1", "Block_2"}
  assert set(scope["metrics"].aux) == {"accuracy"}


def test_readme_plan_example_runs_and_fails_as_it_says():
  """The Plans section's block: the settings land in their values, and its last line raises the error
  its comment quotes."""
  code = [c for c in code_blocks("Plans", "plans.md") if "plan.reduction.hop_bits" in c][0]
  said = re.search(r"# ValueError: (.*)", code).group(1)
  scope = {}
  with pytest.raises(ValueError) as e:
    exec(compile(code, "README.md", "exec"), scope)
  assert str(e.value) == said
  assert scope["prefetched"].schedule.prefetch is True and scope["plan"].schedule.prefetch is None


def test_readme_is_short_and_its_docs_links_exist():
  """A newcomer reads the README in minutes: under 250 lines, its two commands first, the plans table;
  every link to a page under docs/ (and every relative link of those pages) leads to an existing file."""
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) < 250
  first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
  assert first[0].startswith("python3 -m venv .venv && .venv/bin/pip install -e") and "train.py" in first[0]
  assert first[1] == ".venv/bin/python -m pytest -q"
  plans = re.search(r"^## Plans\n(.*?)^## ", text, re.S | re.M).group(1)
  assert plans.startswith("\n| plan (gin file) |")
  assert all(f"`{p}.gin`" in plans for p in ("dp", "zero1", "zero2", "zero3", "zeropp", "mics", "mics_radius"))
  pages = re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)]*)?\)", text)
  assert len(set(pages)) >= 10
  missing = [p for p in pages if not (ROOT / p).is_file()]
  assert missing == [], f"README.md links to missing pages {missing}"
  for page in sorted((ROOT / "docs").glob("*.md")):
    body = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", body):
      if not re.match(r"[a-z]+:", target):
        assert (page.parent / target).exists(), f"docs/{page.name} links to {target}, which does not exist"
