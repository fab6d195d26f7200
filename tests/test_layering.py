"""Subpackages import only downward: model < rollout < speculative < adapt < tasks < rl <
integrations."""
import ast

from tests.conftest import REPO

PACKAGE = REPO / 'specroll_jax'
LAYERS = ('model', 'rollout', 'speculative', 'adapt', 'tasks', 'rl', 'integrations')


def imported_subpackages(source: str) -> set[str]:
  """Subpackages of specroll_jax that `source` imports, at module level or inside functions."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f'{node.module}.{a.name}' for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    else:
      continue
    for name in names:
      parts = name.split('.')
      if parts[0] == 'specroll_jax' and len(parts) > 1 and parts[1] in LAYERS:
        found.add(parts[1])
  return found


def upward_imports(layer: str, source: str) -> set[str]:
  rank = LAYERS.index(layer)
  return {p for p in imported_subpackages(source) if LAYERS.index(p) > rank}


def test_every_module_imports_only_its_own_or_lower_layers():
  violations = []
  for path in sorted(PACKAGE.rglob('*.py')):
    relative = path.relative_to(PACKAGE)
    if len(relative.parts) == 1:
      continue  # specroll_jax/__init__.py re-exports the public entry points
    layer = relative.parts[0]
    assert layer in LAYERS, f'{relative}: not in a layer {LAYERS}'
    for target in upward_imports(layer, path.read_text()):
      violations.append(f'{relative} ({layer}) imports specroll_jax.{target}')
  assert not violations, '\n'.join(violations)


def test_the_check_sees_an_upward_import_in_a_function_body():
  source = 'def f():\n  from specroll_jax.rl import grpo\n  from specroll_jax.model import mesh\n'
  assert upward_imports('speculative', source) == {'rl'}
  assert upward_imports('rl', 'from specroll_jax import speculative\n') == set()
  assert upward_imports('model', 'import specroll_jax.adapt.reflex\n') == {'adapt'}
