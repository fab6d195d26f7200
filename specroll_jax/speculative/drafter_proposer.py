"""The sequential drafter as a proposer: a spine of top-k candidates, one depth at a time.

Depth 1 drafts from (h_t, root); depth d + 1 from the drafter's state after its best guess
at depth d. The candidates are the top `branching[d-1]` tokens of each depth, all hung
below the previous depth's best guess (the spine), so the tree's shape is static and the
drafter runs `levels` block steps and projections per tree step whatever the node budget.
A child of a lower-ranked candidate would need its own block step per rank: more proposing
cost for children the tree builder seldom keeps (their path scores multiply a lower rank's
probability).

An edge's score is the drafter's own probability of the token under the sampler: the
drafter is trained to match the policy's distribution at that position, so it is the
estimated chance that the verifier draws it. Per-(depth, rank) verifier statistics are kept
per row (HeadStats) for reports; the heads' scores blend in those online rates because heads
that cannot see the root are miscalibrated by construction, the drafter's are not.

Reflex does not apply: it corrects a head's output for a fixed horizon from delayed
feedback, while the drafter's depth-d state depends on the tokens drafted before it, so a
correction learned for one draft path does not carry to the next step's. The slow path
would update the drafter's block on the learner's harvested pairs with its own loss
(adapt/drafter_training.py); it is not wired into the trainer yet.
"""
import dataclasses
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax.model.config import ModelConfig
from specroll_jax.rollout import sampling
from specroll_jax.speculative.drafter import DrafterConfig, DrafterParams, drafter_step
from specroll_jax.speculative.head_proposer import HeadGuesses, HeadStats
from specroll_jax.speculative.proposer import Candidates, Feedback, Proposal, Proposer, StepContext


def spine_parents(branching) -> tuple:
  """Static parents of the spine: depth d's candidates hang below depth d-1's first one."""
  parent, first = [], -1
  for width in branching:
    start = len(parent)
    parent.extend([first] * width)
    first = start
  return tuple(parent)


@dataclasses.dataclass(frozen=True)
class DrafterProposer(Proposer):
  model_config: ModelConfig
  config: DrafterConfig
  branching: tuple  # candidates per depth along the spine; len(branching) = tree depth
  sampler: sampling.SamplerConfig

  def __post_init__(self):
    if not self.branching or min(self.branching) < 1:
      raise ValueError(f'branching must be non-empty positive ints, got {self.branching}')
    if len(self.branching) > self.config.depth:
      raise ValueError(f'tree depth {len(self.branching)} (len(branching)) exceeds the '
                       f'drafter\'s trained depth {self.config.depth}')

  @property
  def depth(self) -> int:
    return len(self.branching)

  @property
  def num_candidates(self) -> int:
    return sum(self.branching)

  @cached_property
  def _layout(self):
    """(depth index [C], rank [C]) of each spine candidate: numpy, static across traces."""
    depth = [d for d, width in enumerate(self.branching) for _ in range(width)]
    rank = [r for width in self.branching for r in range(width)]
    return np.asarray(depth), np.asarray(rank)

  def init(self, prompt_tokens, seqs) -> HeadStats:
    del prompt_tokens
    return HeadStats.zeros(seqs.done.shape[0], self.depth, max(self.branching))

  def guesses(self, params: DrafterParams, context: StepContext, levels: int) -> HeadGuesses:
    """Each depth's top tokens along the spine, zero below `levels`."""
    top_k = max(self.branching)
    draft_rows = context.vocab.rows(params.vocab_ids)  # [V_d, D]
    z, token = context.hidden, context.root
    tokens, probs = [], []
    for _ in range(levels):
      z = drafter_step(self.config, self.model_config, params.weights, z,
                       context.vocab.embed(token))
      p, index = jax.lax.top_k(sampling.distribution(z @ draft_rows.T, self.sampler), top_k)
      ids = params.vocab_ids[index]
      tokens.append(ids)
      probs.append(p)
      token = ids[:, 0]
    pad = lambda x: jnp.pad(jnp.stack(x, axis=1), ((0, 0), (0, self.depth - levels), (0, 0)))
    proposed = ~context.seqs.done[:, None] & (jnp.arange(self.depth) < levels)[None, :]
    return HeadGuesses(tokens=pad(tokens), probs=pad(probs), proposed=proposed)

  def propose(self, params: DrafterParams, state: HeadStats, context: StepContext,
              levels: int) -> Proposal:
    del state
    guesses = self.guesses(params, context, levels)
    depth, rank = self._layout
    return Proposal(candidates=Candidates(tokens=guesses.tokens[:, depth, rank],
                                          scores=guesses.probs[:, depth, rank],
                                          parent=spine_parents(self.branching)),
                    record=guesses)

  def observe(self, params, state: HeadStats, context, proposal: Proposal,
              feedback: Feedback) -> HeadStats:
    del params, context
    return state.record(proposal.record, feedback, self.branching)

  def row_stats(self, state: HeadStats) -> HeadStats:
    return state
