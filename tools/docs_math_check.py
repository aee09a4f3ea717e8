"""Checks that the built documentation shows its formulas with no network.

  sphinx-build -q -W docs docs/_build && python tools/docs_math_check.py docs/_build

Opens every page of the built site that has math in headless Chromium (file://, background
networking off; the machine needs no network) and counts the formulas MathJax typeset
(``<mjx-container>``) against the math elements Sphinx wrote. A page whose MathJax comes from a
CDN typesets nothing offline and fails here. Needs Chromium (Debian: ``apt-get install
chromium``; ``--chromium=PATH`` for another binary). Exit status 1 if a page falls short.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

_MATH = re.compile(r'class="math notranslate')
_TYPESET = re.compile(r"<mjx-container")
_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
          "--disable-background-networking", "--disable-component-update", "--disable-sync",
          "--virtual-time-budget=15000")


def typeset(chromium: str, page: str) -> int:
  """The number of formulas MathJax typeset on ``page`` (a built HTML file)."""
  with tempfile.TemporaryDirectory() as profile:
    dom = subprocess.run([chromium, *_FLAGS, f"--user-data-dir={profile}", "--dump-dom",
                          "file://" + os.path.abspath(page)],
                         capture_output=True, text=True, timeout=180).stdout
  return len(_TYPESET.findall(dom))


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("site", help="the built site (sphinx-build's output directory)")
  p.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
  args = p.parse_args(argv)
  if not shutil.which(args.chromium):
    print(f"no Chromium at {args.chromium!r}: install it (Debian: apt-get install chromium) "
          "or pass --chromium=PATH", file=sys.stderr)
    return 2
  short = 0
  pages = sorted(glob.glob(os.path.join(args.site, "**", "*.html"), recursive=True))
  for page in pages:
    with open(page, encoding="utf-8") as f:
      wanted = len(_MATH.findall(f.read()))
    if not wanted:
      continue
    got = typeset(args.chromium, page)
    print(f"{os.path.relpath(page, args.site)}: {got} of {wanted} formulas typeset")
    short += got < wanted
  if not any(True for _ in pages):
    print(f"no HTML pages under {args.site}", file=sys.stderr)
    return 2
  return 1 if short else 0


if __name__ == "__main__":
  sys.exit(main())
