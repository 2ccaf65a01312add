"""The python code blocks of a markdown section, found by its title in README.md or else in its page under
docs/: a docs test runs wherever the text lands."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def section_text(text: str, title: str) -> str | None:
  """The body of the section `title` (any heading level) up to the next heading of the same or a higher
  level, or None."""
  body, level, fenced = None, 0, False
  for line in text.splitlines():
    fenced ^= line.startswith("```")
    m = None if fenced else re.match(r"^(#+) (.*?)\s*$", line)  # a comment in a code block is no heading
    if body is None:
      if m and m.group(2) == title:
        body, level = [], len(m.group(1))
    elif m and len(m.group(1)) <= level:
      break
    else:
      body.append(line)
  return None if body is None else "\n".join(body) + "\n"


def code_blocks(title: str, doc: str) -> list[str]:
  """The ```python blocks of section `title` in README.md, else in docs/`doc`."""
  for path in (ROOT / "README.md", ROOT / "docs" / doc):
    body = section_text(path.read_text(), title) if path.exists() else None
    if body is not None:
      return re.findall(r"```python\n(.*?)```", body, re.S)
  raise AssertionError(f"no section '{title}' in README.md or docs/{doc}")
