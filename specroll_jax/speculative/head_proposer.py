"""Horizon heads as a proposer: head d's top ranks are the candidates at depth d.

Heads see only h_t, the hidden state of the last verified position, so every depth-(d-1)
candidate gets the same children: the top `branching[d-1]` tokens of head d. The
candidates are therefore every path of head ranks (`CandidateTable`, static). An edge's
score estimates its acceptance as a blend of the head's own probability (dynamic, per
response) and the running rate at which the verifier drew that (head, rank) token for this
row (`DepthStats`, seeded by the warm start's held-out hit rates).
"""
import dataclasses
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specroll_jax.model.config import ModelConfig
from specroll_jax.rollout import sampling
from specroll_jax.speculative.heads import HeadsConfig, apply_heads
from specroll_jax.speculative.proposer import Candidates, Feedback, Proposal, Proposer, StepContext


@dataclasses.dataclass(frozen=True)
class CandidateTable:
  """Every rank path a tree may use, parents listed before children (numpy, static)."""
  depth: np.ndarray       # [C] 1..H
  rank: np.ndarray        # [C] rank within its head's top-k
  parent: np.ndarray      # [C] candidate index of the parent, -1 for the root

  @property
  def size(self) -> int:
    return len(self.depth)

  @classmethod
  def build(cls, branching) -> 'CandidateTable':
    depth, rank, parent = [], [], []
    frontier = [-1]
    for d, width in enumerate(branching, start=1):
      next_frontier = []
      for parent_index in frontier:
        for r in range(width):
          depth.append(d)
          rank.append(r)
          parent.append(parent_index)
          next_frontier.append(len(depth) - 1)
      frontier = next_frontier
    return cls(np.array(depth, np.int32), np.array(rank, np.int32), np.array(parent, np.int32))


@dataclasses.dataclass(frozen=True)
class HeadDraftConfig:
  branching: tuple = (8, 4, 2, 2)  # candidate ranks per depth; len(branching) = heads used
  head_weight: float = 0.5         # weight of head probability vs online acceptance rate
  prior_strength: float = 4.0      # pseudo-trials behind the initial acceptance rates

  def __post_init__(self):
    if not self.branching or min(self.branching) < 1:
      raise ValueError(f'branching must be non-empty positive ints, got {self.branching}')
    if not 0.0 <= self.head_weight <= 1.0:
      raise ValueError(f'head_weight must be in [0, 1], got {self.head_weight}')

  @property
  def depth(self) -> int:
    return len(self.branching)

  @property
  def top_k(self) -> int:
    return max(self.branching)

  @cached_property
  def table(self) -> CandidateTable:
    return CandidateTable.build(self.branching)


@struct.dataclass
class DepthStats:
  """Per-row verifier feedback per draft depth (a head, or a drafter depth along its spine):
  where the walk drew, and which rank it matched."""
  reached: jax.Array         # float32 [B, H] draws at depth d while head d proposed
  hits: jax.Array            # float32 [B, H, K] of those, draws equal to head d's rank-r token
  candidate_mass: jax.Array  # float32 [B, H] policy mass on head d's candidates, where reached

  @classmethod
  def zeros(cls, batch: int, depth: int, top_k: int) -> 'DepthStats':
    return cls(reached=jnp.zeros((batch, depth)), hits=jnp.zeros((batch, depth, top_k)),
               candidate_mass=jnp.zeros((batch, depth)))

  def acceptance_rate(self, prior, prior_strength: float) -> jax.Array:
    """[B, H, K] running rate of (head, rank) hits, shrunk toward `prior` [H, K]."""
    return (self.hits + prior_strength * prior) / (self.reached[..., None] + prior_strength)

  def record(self, guesses: 'HeadGuesses', feedback: Feedback, branching) -> 'DepthStats':
    reached = feedback.in_tree & guesses.proposed
    hits = reached[..., None] & (guesses.tokens == feedback.drawn[..., None])
    top_k = guesses.tokens.shape[-1]
    in_candidates = jnp.arange(top_k)[None, :] < jnp.asarray(branching)[:, None]
    on_candidates = jnp.any((feedback.target_ids[..., None] == guesses.tokens[:, :, None, :])
                            & in_candidates[None, :, None, :], axis=-1)
    mass = jnp.sum(jnp.where(on_candidates, feedback.target_probs, 0.0), axis=-1)
    return DepthStats(reached=self.reached + reached, hits=self.hits + hits,
                     candidate_mass=self.candidate_mass + jnp.where(reached, mass, 0.0))


@struct.dataclass
class HeadGuesses:
  """Each head's top-K tokens for its depth, zero below the depths evaluated this step."""
  tokens: jax.Array    # int32 [B, H, K] best first
  probs: jax.Array     # float32 [B, H, K] their probabilities under the sampler
  proposed: jax.Array  # bool [B, H] head d was evaluated for a running row


@dataclasses.dataclass(frozen=True)
class HeadProposer(Proposer):
  model_config: ModelConfig
  heads_config: HeadsConfig
  draft: HeadDraftConfig
  sampler: sampling.SamplerConfig
  prior_accept: tuple | None = None  # [H][K] initial acceptance rates; None: head probs only
  # The policy's top tokens per drawn depth that DepthStats.candidate_mass sums over (the
  # slow-path monitor's regret, adapt/monitor.py).
  feedback_top_m: int = 32

  def __post_init__(self):
    if self.draft.depth > self.heads_config.num_heads:
      raise ValueError(f'tree depth {self.draft.depth} (len(branching)) exceeds the '
                       f'{self.heads_config.num_heads} trained heads')

  @property
  def depth(self) -> int:
    return self.draft.depth

  @property
  def num_candidates(self) -> int:
    return self.draft.table.size

  def init(self, prompt_tokens, seqs) -> DepthStats:
    del prompt_tokens
    return DepthStats.zeros(seqs.done.shape[0], self.depth, self.draft.top_k)

  def head_states(self, params, hidden, levels: int):
    """z [B, levels, D]: the first `levels` heads' hidden outputs (a tree of N slots never
    reaches below N - 1, so deeper heads are not evaluated)."""
    return apply_heads(self.heads_config, self.model_config, params, hidden)[:, :levels]

  def guesses(self, z, context: StepContext) -> HeadGuesses:
    levels = z.shape[1]
    vocab_ids = self.heads_config.vocab_ids()
    logits = context.vocab.draft_logits(z, vocab_ids)
    probs, tokens = jax.lax.top_k(sampling.distribution(logits, self.sampler), self.draft.top_k)
    if vocab_ids is not None:
      tokens = vocab_ids[tokens]
    pad = lambda x: jnp.pad(x, ((0, 0), (0, self.depth - levels), (0, 0)))
    proposed = ~context.seqs.done[:, None] & (jnp.arange(self.depth) < levels)[None, :]
    return HeadGuesses(tokens=pad(tokens.astype(jnp.int32)), probs=pad(probs),
                       proposed=proposed)

  def _prior(self):
    """[depth, K] prior acceptance rates; ranks the warm start did not measure get 0."""
    prior = np.zeros((self.depth, self.draft.top_k), np.float32)
    if self.prior_accept is not None:
      measured = np.asarray(self.prior_accept, np.float32)[:self.depth, :self.draft.top_k]
      prior[:measured.shape[0], :measured.shape[1]] = measured
    return jnp.asarray(prior)

  def candidates(self, guesses: HeadGuesses, stats: DepthStats) -> Candidates:
    d = self.draft
    rate = stats.acceptance_rate(self._prior(), d.prior_strength)
    edge = d.head_weight * guesses.probs + (1.0 - d.head_weight) * rate
    depth, rank = d.table.depth - 1, d.table.rank
    return Candidates(tokens=guesses.tokens[:, depth, rank], scores=edge[:, depth, rank],
                      parent=tuple(int(p) for p in d.table.parent))

  def propose(self, params, state: DepthStats, context: StepContext, levels: int) -> Proposal:
    guesses = self.guesses(self.head_states(params, context.hidden, levels), context)
    return Proposal(candidates=self.candidates(guesses, state), record=guesses)

  def observe(self, params, state: DepthStats, context, proposal: Proposal,
              feedback: Feedback) -> DepthStats:
    del params, context
    return state.record(proposal.record, feedback, self.draft.branching)

  def row_stats(self, state: DepthStats) -> DepthStats:
    return state

  def head_stats(self, stats: DepthStats) -> DepthStats:
    """The heads' part of this proposer's row statistics (what the slow path reads)."""
    return stats
