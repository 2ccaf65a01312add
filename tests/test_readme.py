"""The README's API example runs as written."""
import pathlib
import re

import numpy as np
import pytest


def test_readme_api_example_runs():
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  code = [c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "zerojax.Model(" in c][0]
  scope = {}
  exec(compile(code, "README.md", "exec"), scope)
  assert int(scope["state"].step) == 1 and np.isfinite(float(scope["metrics"].loss))
  assert scope["params"]["layers"]["w"].shape == (4, 64, 64)


def test_readme_flax_example_runs():
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  code = [c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "zerojax.from_linen" in c][0]  # "Your own flax model"
  scope = {}
  exec(compile(code, "README.md", "exec"), scope)
  assert int(scope["state"].step) == 1 and np.isfinite(float(scope["metrics"].loss))
  assert scope["params"]["Block_0"]["Dense_0"]["kernel"].shape == (32, 32)
  assert set(scope["stats"]) == {"Block_0", "Block_1", "Block_2"}
  assert set(scope["metrics"].aux) == {"accuracy"}


def test_readme_plan_example_runs_and_fails_as_it_says():
  """The Plans section's block: the settings land in their values, and its last line raises the error
  its comment quotes."""
  text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
  code = [c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "plan.reduction.hop_bits" in c][0]
  said = re.search(r"# ValueError: (.*)", code).group(1)
  scope = {}
  with pytest.raises(ValueError) as e:
    exec(compile(code, "README.md", "exec"), scope)
  assert str(e.value) == said
  assert scope["prefetched"].schedule.prefetch is True and scope["plan"].schedule.prefetch is None
