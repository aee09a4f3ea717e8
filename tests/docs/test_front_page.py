"""The README is a front page: short, and one click from what a new user looks for."""

from __future__ import annotations

import os
import re

from tests.support.doc_blocks import ROOT

README = os.path.join(ROOT, "README.md")
MAX_LINES = 250
# What a new user must reach in one click from the README (the documentation issue's list).
ONE_CLICK = {
    "how to add an F": "docs/guides/formula.md#adding-your-own-f",
    "the language-model results": "docs/results/language_model.md",
    "the kernel benchmark": "docs/guides/benchmarks.md",
    "the exit statuses": "docs/guides/experiments.md#exit-statuses",
}


def _slug(heading: str) -> str:
  """The anchor GitHub and MyST (myst_heading_anchors) give a heading."""
  text = re.sub(r"[`*]", "", heading.strip().lower())
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def _anchors(path: str) -> set[str]:
  text = open(os.path.join(ROOT, path), encoding="utf-8").read()
  text = re.sub(r"(?ms)^```.*?^```", "", text)  # a "# comment" in a code block is no heading
  return {_slug(h) for h in re.findall(r"(?m)^#{1,6} (.+)$", text)}


def _links(text: str) -> list[str]:
  return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+://", t)]


def test_readme_is_short():
  n = len(open(README, encoding="utf-8").read().splitlines())
  assert n <= MAX_LINES, f"README has {n} lines; move detail to docs/ (the front page is ≤ 250)"


def test_readme_links_resolve_to_pages_and_headings():
  links = _links(open(README, encoding="utf-8").read())
  assert len(links) >= 10
  for link in links:
    path, _, anchor = link.partition("#")
    assert os.path.exists(os.path.join(ROOT, path)), f"README links to missing {path}"
    if anchor:
      assert anchor in _anchors(path), f"README links to {link}: no such heading in {path}"


def test_what_users_look_for_is_one_click_away():
  links = set(_links(open(README, encoding="utf-8").read()))
  for what, target in ONE_CLICK.items():
    assert target in links, f"the README does not link {what} ({target})"


def test_slugs_are_the_anchors_headings_get():
  assert _slug("Adding your own F") == "adding-your-own-f"
  assert _slug("Training machinery: seeds via vmap, devices via shard_map/pmap") == (
      "training-machinery-seeds-via-vmap-devices-via-shard_mappmap")
