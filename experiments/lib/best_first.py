"""Best-first trees under the policy's own law: the ceiling of trees shaped per position.

A drafter that knew the policy's law at every node would grow, at each position of an
answer, the N-node tree the T=1 walk is most likely to go down: the walk accepts a node
exactly when the policy's draws follow its path, with probability the product of the
policy's probabilities along it, so the tree's expected accepted depth is the sum of its
non-root nodes' path probabilities. A path is never more probable than its prefix, so the
N-1 most probable paths are prefix-closed, and best-first expansion (pop the most probable
path on the frontier, push its children) pops them in order: the first N-1 popped
probabilities give the best tree of every size N at once, tau_N = 1 + their sum (the bonus
token). A popped end-of-sequence token has no children (generation stops there). A node
below rank N-1 among its siblings can never be popped in the first N-1, so each expansion
pushes only the top N-1 children.

Each expansion step runs every position's next node in one forward over the answer and
the nodes' paths, each path token seeing the answer up to its position and its own path.
"""
import heapq
from functools import partial

import jax
import numpy as np

from specroll_jax.model.transformer import Transformer

# Sequence lengths and query counts are padded to multiples of these: few compilations.
LENGTH_QUANTUM = 256
QUERY_QUANTUM = 64


def laws_at(policy, tokens, positions, mask, last, top_k: int):
  """The policy's top-`top_k` next-token probabilities and ids after tokens[last] (numpy
  [M, top_k]): tokens, positions [T] and the attention mask [T, T] of one sequence."""
  padded = np.zeros(-(-len(last) // QUERY_QUANTUM) * QUERY_QUANTUM, np.int32)
  padded[:len(last)] = last
  probs, ids = _laws_at(policy.config, policy.params, tokens, positions, mask, padded, top_k)
  return np.asarray(probs)[:len(last)], np.asarray(ids)[:len(last)]


@partial(jax.jit, static_argnums=(0, 6))
def _laws_at(model_config, params, tokens, positions, mask, last, top_k: int):
  model = Transformer(model_config)
  hidden, _ = model.apply({'params': params}, tokens[None], positions[None], mask[None])
  logits = model.apply({'params': params}, hidden[0, last], method=Transformer.project)
  return jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)


def _layout(answer, paths):
  """One sequence: the answer, then each (position t, path) as path tokens at positions
  t+1, t+2, ..., seeing the answer up to t and their own path. Padded to LENGTH_QUANTUM;
  padding sees only itself. Returns tokens, positions, mask, and each path's last index."""
  width = len(answer)
  total = width + sum(len(p) for _, p in paths)
  padded = -(-total // LENGTH_QUANTUM) * LENGTH_QUANTUM
  tokens = np.zeros(padded, np.int32)
  positions = np.zeros(padded, np.int32)
  mask = np.eye(padded, dtype=bool)
  tokens[:width], positions[:width] = answer, np.arange(width)
  mask[:width, :width] = np.tril(np.ones((width, width), bool))
  last, at = [], width
  for t, path in paths:
    span = np.arange(at, at + len(path))
    tokens[span], positions[span] = path, t + 1 + np.arange(len(path))
    mask[span, :t + 1] = True
    mask[span[:, None], span[None, :]] = np.tril(np.ones((len(path), len(path)), bool))
    at += len(path)
    last.append(at - 1)
  return tokens, positions, mask, np.asarray(last, np.int32)


def popped_probabilities(policy, answer, span, budget: int, eos_ids) -> np.ndarray:
  """[len(span), budget - 1]: at each position t of `span` (the next token follows t), the
  path probabilities best-first expansion pops, in order (0 where nothing is left)."""
  top_k = budget - 1
  answer = np.asarray(answer, np.int32)
  tokens, positions, mask, _ = _layout(answer, [])
  probs, ids = laws_at(policy, tokens, positions, mask, np.asarray(span, np.int32), top_k)
  frontiers = [[(-float(p), (int(i),)) for p, i in zip(row_p, row_i)]
               for row_p, row_i in zip(probs, ids)]
  for frontier in frontiers:
    heapq.heapify(frontier)
  popped = np.zeros((len(span), top_k))
  for step in range(top_k):
    expand = []
    for row, frontier in enumerate(frontiers):
      if not frontier:
        continue
      negative, path = heapq.heappop(frontier)
      popped[row, step] = -negative
      if step < top_k - 1 and path[-1] not in eos_ids:
        expand.append((row, path, -negative))
    if not expand:
      break
    tokens, positions, mask, last = _layout(answer, [(span[row], path) for row, path, _ in expand])
    probs, ids = laws_at(policy, tokens, positions, mask, last, top_k)
    for (row, path, prob), row_p, row_i in zip(expand, probs, ids):
      for p, i in zip(row_p, row_i):
        heapq.heappush(frontiers[row], (-prob * float(p), path + (int(i),)))
  return popped
