"""The proposer interface: what drafts a speculative step's candidates and learns from the walk.

A proposer is a frozen dataclass (a static argument of the jitted step, like the engine)
with per-row state: a pytree the engine creates with the rows and carries through the
rollout loop, so a row's state lives exactly as long as its response.

  init(prompt_tokens, seqs)                    -> state
  propose(params, state, context, levels)      -> Proposal
  observe(params, state, context, proposal, feedback) -> state
  row_stats(state)                             -> typed per-row statistics (Response.stats)
  summarize(stats, steps)                      -> dict of host-side summaries

`levels` (static) is how deep this step's tree can reach; a proposer need not draft below
it. `feedback_top_m` (static) is how many of the policy's top tokens per drawn depth the
proposer reads in its Feedback; the walk computes that top-M (a softmax and a top-k over
the vocabulary at every depth) only when some proposer asks for it.

Candidates are edges (parent candidate, token, score) in a static order with parents
first (the parents may differ per row, at a static depth), so drafts from different sources
(per-depth head candidates, chains from a suffix match, the oracle's true future) can be
concatenated and share one node budget in the tree builder. Exactness never depends on a
proposer: it only decides what the verifier may accept.
"""
import abc
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specroll_jax.model.config import ModelConfig
from specroll_jax.model.transformer import Transformer, final_hidden
from specroll_jax.rollout.sequences import Sequences


def static_depths(parent: tuple) -> np.ndarray:
  """int32 [C]: each candidate's depth (1 below the root) from parents that come first."""
  depth = np.zeros(len(parent), np.int32)
  for c, p in enumerate(parent):
    if p >= c:
      raise ValueError(f'candidate {c} has parent {p}: parents must come first')
    depth[c] = depth[p] + 1 if p >= 0 else 1
  return depth


@struct.dataclass
class Candidates:
  """Draft edges for the tree builder; candidate c hangs below candidate parent[c].

  Every candidate sits at a static depth below a static parent, and for most proposers that
  parent is the same in every row (per-depth head candidates, chains, a drafter's rank
  paths): what varies per row is each edge's token and score (score 0: nothing to offer
  there). A proposer that chooses per row which nodes to expand (a drafter's best-first
  expansion, EAGLE-2's dynamic trees) gives `row_parents` too: each row's parent of c is a
  candidate of the same depth as parent[c], before c.
  """
  tokens: jax.Array  # int32 [B, C]
  scores: jax.Array  # float32 [B, C] estimated probability that the verifier accepts the edge
  parent: tuple = struct.field(pytree_node=False)  # [C] parent candidate (< c); -1 = root
  row_parents: jax.Array | None = None  # int32 [B, C] per-row parents; None: `parent`

  @property
  def size(self) -> int:
    return len(self.parent)

  @property
  def depths(self) -> np.ndarray:
    return static_depths(self.parent)

  def parents(self) -> jax.Array:
    """int32 [B, C]: each row's parent of each candidate (-1: the root)."""
    if self.row_parents is not None:
      return self.row_parents
    return jnp.broadcast_to(jnp.asarray(self.parent, jnp.int32), self.tokens.shape)

  def along_paths(self, values, combine, start) -> jax.Array:
    """[B, C]: combine(...combine(combine(start, v_1), v_2)..., v_c) over the values of each
    candidate's path from depth 1 down to itself, in that order in every row (so equal
    values along equal paths give equal bits)."""
    parents, depths = self.parents(), self.depths
    total = jnp.zeros_like(values)
    for d in range(1, int(depths.max(initial=0)) + 1):
      at = np.flatnonzero(depths == d)
      above = (jnp.full_like(values[:, at], start) if d == 1
               else jnp.take_along_axis(total, parents[:, at], axis=1))
      total = total.at[:, at].set(combine(above, values[:, at]))
    return total

  def concat(self, other: 'Candidates') -> 'Candidates':
    """self's candidates, then other's (their parents shifted past self's)."""
    shifted = tuple(p + self.size if p >= 0 else -1 for p in other.parent)
    row_parents = None
    if self.row_parents is not None or other.row_parents is not None:
      theirs = other.parents()
      row_parents = jnp.concatenate(
          [self.parents(), jnp.where(theirs >= 0, theirs + self.size, -1)], axis=1)
    return Candidates(tokens=jnp.concatenate([self.tokens, other.tokens], axis=1),
                      scores=jnp.concatenate([self.scores, other.scores], axis=1),
                      parent=self.parent + shifted, row_parents=row_parents)


@struct.dataclass
class Vocabulary:
  """The policy's vocabulary projection W: logits of hidden states, and rows W[ids]."""
  params: dict
  config: ModelConfig = struct.field(pytree_node=False)

  def logits(self, hidden) -> jax.Array:
    return Transformer(self.config).apply({'params': self.params}, hidden,
                                          method=Transformer.project)

  def rows(self, ids) -> jax.Array:
    return Transformer(self.config).apply({'params': self.params}, ids,
                                          method=Transformer.vocab_rows)

  def draft_logits(self, hidden, vocab_ids) -> jax.Array:
    """float32 logits [..., V_d] of hidden states over a draft vocabulary's rows only, or
    over the whole vocabulary when `vocab_ids` is None."""
    if vocab_ids is None:
      return self.logits(hidden)
    return hidden.astype(jnp.float32) @ self.rows(vocab_ids).T

  def embed(self, ids) -> jax.Array:
    """The policy's input embeddings of tokens (what a drafter reads its last token as)."""
    return Transformer(self.config).apply({'params': self.params}, ids,
                                          method=Transformer.embed)


@struct.dataclass
class StepContext:
  """What a proposer may read at a step, per row."""
  # [B, (1 + L) D] at the last verified position: the policy's final hidden state h_t, then
  # the outputs of the proposer's `feature_layers` (L of them; none for most proposers).
  features: jax.Array
  root: jax.Array    # int32 [B] this step's root draw: candidates at depth 1 follow it
  seqs: Sequences    # the rows' output so far (positions, response ids, done) before the step
  vocab: Vocabulary

  @property
  def hidden(self) -> jax.Array:
    """[B, D] the policy's final hidden state h_t at the last verified position."""
    return final_hidden(self.vocab.config, self.features)


@struct.dataclass
class Proposal:
  candidates: Candidates
  record: Any  # the proposer's own pytree, handed back to its observe


@struct.dataclass
class Feedback:
  """What the verification walk learned this step, per row."""
  drawn: jax.Array         # int32 [B, H] the verifier's draw at each depth (valid where drew)
  drew: jax.Array          # bool [B, H] a running row's walk drew at this depth
  accepted: jax.Array      # int32 [B] accepted nodes below the root
  target_ids: jax.Array    # int32 [B, H, M] top-M of the policy's distribution at each depth
  target_probs: jax.Array  # float32 [B, H, M] their probabilities under the sampler
  # [B, H + 1, (1 + L) D] the verifier's features along the accepted path, root first (valid
  # up to depth `accepted`; laid out as StepContext.features): what a drafter caches about
  # the accepted tokens.
  path_features: jax.Array
  levels: int = struct.field(pytree_node=False)  # depths this step's tree could reach

  def first_levels(self, depth: int) -> 'Feedback':
    """The feedback of the first `depth` levels (what a shallower proposer inside a deeper
    one reads)."""
    return Feedback(drawn=self.drawn[:, :depth], drew=self.drew[:, :depth],
                    accepted=jnp.minimum(self.accepted, depth),
                    target_ids=self.target_ids[:, :depth],
                    target_probs=self.target_probs[:, :depth],
                    path_features=self.path_features[:, :depth + 1],
                    levels=min(self.levels, depth))

  @property
  def in_tree(self) -> jax.Array:
    """bool [B, H]: drew at a depth the tree had candidates for (the walk may draw one
    level below the deepest node; that draw is the next step's root)."""
    return self.drew & (jnp.arange(self.drew.shape[1]) < self.levels)[None, :]


class Proposer(abc.ABC):
  """Subclasses are frozen dataclasses (hashable: the jitted step's static argument)."""

  @property
  @abc.abstractmethod
  def depth(self) -> int:
    """Deepest level a candidate can sit at (the tree's depth H)."""

  @property
  @abc.abstractmethod
  def num_candidates(self) -> int:
    """C, the static number of candidates `propose` returns."""

  @abc.abstractmethod
  def init(self, prompt_tokens, seqs: Sequences):
    """Fresh per-row state for the rows of `seqs` (responses of up to seqs.tokens.shape[1]
    tokens), whose prompts are `prompt_tokens` (int32 [B, P], right-padded)."""

  @abc.abstractmethod
  def propose(self, params, state, context: StepContext, levels: int) -> Proposal:
    """Candidates for this step's tree."""

  @abc.abstractmethod
  def observe(self, params, state, context: StepContext, proposal: Proposal,
              feedback: Feedback):
    """The state after the verifier's feedback on `proposal`."""

  @property
  def feedback_top_m(self) -> int:
    """M of Feedback.target_ids/target_probs that `observe` reads (0: it reads neither)."""
    return 0

  @property
  def feature_layers(self) -> tuple:
    """Decoder layers (0-based) whose outputs the proposer reads beside h_t in
    StepContext.features and Feedback.path_features (EAGLE-3's fused features); the engine
    captures them in every forward. (): h_t alone."""
    return ()

  def row_stats(self, state):
    del state
    return None

  def summarize(self, stats: list, steps: list) -> dict:
    """Host-side summaries of responses' row_stats (numpy leaves) and their engine steps."""
    del stats, steps
    return {}
