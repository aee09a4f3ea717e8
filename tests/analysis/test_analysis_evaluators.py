"""attnx.analysis.evaluators: attnx.analysis sits above attnx.train, so attnx.train imports
nothing of it (not even inside a function), and importing attnx.analysis registers the
"attention_stats" evaluator (its values: tests/analysis/test_stats.py)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _imports(path: str) -> set[str]:
  """Every module a file imports, at any depth (``from a import b`` gives a and a.b)."""
  with open(path) as f:
    tree = ast.parse(f.read())
  out: set[str] = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names)
  return out


def test_attnx_train_imports_nothing_of_attnx_analysis():
  train_dir = os.path.join(ROOT, "attnx", "train")
  files = [f for f in os.listdir(train_dir) if f.endswith(".py")]
  assert "evaluators.py" in files
  for name in files:
    bad = {m for m in _imports(os.path.join(train_dir, name))
           if m == "attnx.analysis" or m.startswith("attnx.analysis.")}
    assert not bad, (name, bad)


def _fresh(code: str) -> str:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                        cwd=ROOT, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.split()


def test_importing_analysis_registers_attention_stats_in_either_order():
  train_first = _fresh(
      "import sys\n"
      "from attnx.train import evaluators\n"
      "print('analysis' in str([m for m in sys.modules if m.startswith('attnx.analysis')]),\n"
      "      'attention_stats' in evaluators.list_evaluators())\n"
      "try:\n"
      "  evaluators.check_evaluators(('attention_stats',))\n"
      "except ValueError as e:\n"
      "  print(str(e).endswith('registered by `import attnx.analysis`'))\n"
      "import attnx.analysis\n"
      "print('attention_stats' in evaluators.list_evaluators())\n")
  assert train_first == ["False", "False", "True", "True"]
  analysis_first = _fresh(
      "import attnx.analysis\n"
      "from attnx.train import evaluators\n"
      "evaluators.check_evaluators(('attention_stats', 'loss_by_length'))\n"
      "print(evaluators.list_evaluators().count('attention_stats'))\n")
  assert analysis_first == ["1"]
