"""The oracle: the true future as a draft chain, the ceiling of a tree design on a workload.

The true future is the vanilla rollout's tokens by response id, so the chain is always
accepted to its end (up to sampling near-ties). Alone, the chain is the whole tree and the
oracle pays for nothing else: no heads are projected, and the walk keeps none of the
policy's top tokens, since nothing reads them. Merged with a base proposer, the base's
candidates fill the rest of the node budget and keep their own state and statistics as
they would without the oracle (the exactness tests drive the GRPO default's drafting that
way). Benchmarks run the chain alone to separate what the tree and the verification forward
cost from what better drafts could gain.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specroll_jax.speculative.proposer import Candidates, Proposal, Proposer


@struct.dataclass
class OracleParams:
  base: Any                # the base proposer's parameters (None without a base)
  future_tokens: jax.Array  # int32 [R, max_new_tokens] the vanilla rollout by response id


@dataclasses.dataclass(frozen=True)
class OracleProposer(Proposer):
  chain_depth: int              # tokens of the true future offered after each root
  base: Proposer | None = None  # whose candidates fill the rest of the budget (None: none)

  def __post_init__(self):
    if self.chain_depth < 1:
      raise ValueError(f'chain_depth must be >= 1, got {self.chain_depth}')

  @property
  def depth(self) -> int:
    return max(self.chain_depth, self.base.depth if self.base else 0)

  @property
  def num_candidates(self) -> int:
    return self.chain_depth + (self.base.num_candidates if self.base else 0)

  @property
  def feedback_top_m(self) -> int:
    return self.base.feedback_top_m if self.base else 0

  @property
  def feature_layers(self) -> tuple:
    return self.base.feature_layers if self.base else ()

  def init(self, prompt_tokens, seqs):
    return self.base.init(prompt_tokens, seqs) if self.base else None

  def propose(self, params: OracleParams, state, context, levels: int) -> Proposal:
    seqs = context.seqs
    # The chain's node at depth d sits d tokens after the root, whose index is num_generated.
    future = seqs.num_generated[:, None] + jnp.arange(1, self.chain_depth + 1)
    true = params.future_tokens.at[seqs.response_ids[:, None], future].get(
        mode='fill', fill_value=0)
    chain = Candidates(tokens=true.astype(jnp.int32), scores=jnp.ones(true.shape, jnp.float32),
                       parent=tuple(range(-1, self.chain_depth - 1)))
    if not self.base:
      return Proposal(candidates=chain, record=None)
    inner = self.base.propose(params.base, state, context, min(levels, self.base.depth))
    return Proposal(candidates=chain.concat(inner.candidates), record=inner.record)

  def observe(self, params: OracleParams, state, context, proposal, feedback):
    if not self.base:
      return state
    return self.base.observe(params.base, state, context, proposal,
                             feedback.first_levels(self.base.depth))

  def row_stats(self, state):
    return self.base.row_stats(state) if self.base else None

  def summarize(self, stats: list, steps: list) -> dict:
    return self.base.summarize(stats, steps) if self.base else {}
