"""Best-first trees under the policy's law against brute force (stories260K): the popped
probabilities are the most probable paths, in order."""
import numpy as np

from experiments.lib.best_first import popped_probabilities

BUDGET = 4
# Both sides are float32 forwards of the same model over the same tokens, in different
# layouts (one masked sequence against a plain causal forward per path), so they differ
# only in summation order: measured at most 1.3e-6 relative over the 9 positions of this
# sentence (its probabilities are products of up to 3 softmax entries from float64 sums of
# float32 logits here, of float32 softmaxes there).
SUMMATION_ORDER = 1e-5


def _law(policy, tokens):
  logits = np.asarray(policy.logits([tokens]), np.float64)[0, -1]
  probs = np.exp(logits - logits.max())
  return probs / probs.sum()


def _all_paths(policy, prefix, depth):
  """(probability, path) of every path of up to `depth` tokens through each node's top
  BUDGET-1 children: the best BUDGET-1 paths are among them."""
  found, layer = [], [(1.0, ())]
  for _ in range(depth):
    deeper = []
    for prob, path in layer:
      law = _law(policy, prefix + list(path))
      for token in np.argsort(-law)[:BUDGET - 1]:
        deeper.append((prob * law[token], path + (int(token),)))
    found += deeper
    layer = deeper
  return found


def test_popped_probabilities_are_the_most_probable_paths_in_order(stories_policy):
  answer = [1] + stories_policy.tokenizer.encode('Once upon a time there was a little cat')
  span = np.array([4, 9])
  popped = popped_probabilities(stories_policy, answer, span, BUDGET, eos_ids=())
  for row, t in enumerate(span):
    paths = sorted(_all_paths(stories_policy, answer[:t + 1], BUDGET - 1), reverse=True)
    best = np.array([p for p, _ in paths[:BUDGET - 1]])
    np.testing.assert_allclose(popped[row], best, rtol=SUMMATION_ORDER)
    assert np.all(np.diff(popped[row]) <= 0)
