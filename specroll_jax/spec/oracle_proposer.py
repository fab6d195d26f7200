"""The oracle: the true future as a draft chain, the ceiling of a tree design on a workload.

The true future is the vanilla rollout's tokens by response id, so the chain is always
accepted to its end (up to sampling near-ties); it is merged with a base proposer's
candidates, which fill the rest of the node budget and keep their own state and statistics
as they would without the oracle. Benchmarks use it to separate what the tree and the
verification forward cost from what better drafts could gain.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from specroll_jax.spec.proposer import Candidates, Proposal, Proposer


@struct.dataclass
class OracleParams:
  base: Any                # the base proposer's parameters
  future_tokens: jax.Array  # int32 [R, max_new_tokens] the vanilla rollout by response id


@dataclasses.dataclass(frozen=True)
class OracleProposer(Proposer):
  base: Proposer

  @property
  def depth(self) -> int:
    return self.base.depth

  @property
  def num_candidates(self) -> int:
    return self.depth + self.base.num_candidates

  def init(self, prompt_tokens, seqs):
    return self.base.init(prompt_tokens, seqs)

  def propose(self, params: OracleParams, state, context, levels: int) -> Proposal:
    inner = self.base.propose(params.base, state, context, levels)
    seqs = context.seqs
    # The chain's node at depth d sits d tokens after the root, whose index is num_generated.
    future = seqs.num_generated[:, None] + jnp.arange(1, self.depth + 1)
    true = params.future_tokens.at[seqs.response_ids[:, None], future].get(
        mode='fill', fill_value=0)
    chain = Candidates(tokens=true.astype(jnp.int32), scores=jnp.ones(true.shape, jnp.float32),
                       parent=tuple(range(-1, self.depth - 1)))
    return Proposal(candidates=chain.concat(inner.candidates), record=inner.record)

  def observe(self, params: OracleParams, state, context, proposal, feedback):
    return self.base.observe(params.base, state, context, proposal, feedback)

  def row_stats(self, state):
    return self.base.row_stats(state)

  def summarize(self, stats: list, steps: list) -> dict:
    return self.base.summarize(stats, steps)
