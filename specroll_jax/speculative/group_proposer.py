"""Drafts from the GRPO group: continuations of the row's last tokens found in its own prompt
and in the responses of its siblings (the other samples of the same prompt).

A group's samples answer one question, so they repeat its numbers and each other's steps.
Each step, the row's last n tokens (ending with this step's root draw; the longest n in
[min_match, max_match] that occurs) are matched against a per-row corpus: the prompt, then
every sibling's response so far, the row's own included. The continuations after the
most recent `matches` occurrences are scored by frequency, as in a suffix tree over the
corpus (SuffixDecoding's scoring): the score of a chain's token at depth d is the share of
the occurrences agreeing with the chain to depth d - 1 that also agree at d. Up to
`chains` chains with distinct first tokens are proposed, most supported first.

Frequencies are not acceptance probabilities (one occurrence gives frequency 1; a T=1
policy accepts a copy less often), so each row calibrates them online: the factor is the
chain tokens the verifier drew over the frequencies it predicted, counted wherever the walk
reached a chain node whether or not the node was in the tree, and shrunk toward
`prior_acceptance`. A source that stops paying stops getting nodes.

The group drafts are merged with a base proposer's candidates (the horizon heads) into one
candidate set, chains first; where both start with the same token, the one with the more
valuable best path keeps it (`merge`), so no token path is verified twice.

Siblings are the rows of the same batch whose prompts are identical, found when the batch
starts. Each row keeps its own copy of their tokens (`GroupBuffer`), refreshed from the
live rows at every tree step, so a sibling that finishes and is compacted out of the batch
still counts with its tokens as of the last tree step it was present for. Samples of a
prompt that the driver puts in another chunk of max_batch rows are not seen. Drafts read
only tokens emitted before this step and the root: they decide what the verifier may
accept, never what is emitted.
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specroll_jax.rollout.sequences import Sequences
from specroll_jax.speculative.proposer import Candidates, Feedback, Proposal, Proposer, StepContext

# Corpus padding and separators: never equal to a token, so no match runs across them.
_GAP = -1
# The tail before the start of a row's text: never equal to a token or to _GAP.
_BEFORE_TEXT = -2


@dataclasses.dataclass(frozen=True)
class GroupDraftConfig:
  chains: int = 4             # K: chains per row, with distinct first tokens
  chain_depth: int = 8        # D: tokens per chain
  min_match: int = 2          # shortest tail that counts as a match
  max_match: int = 16         # longest tail compared
  matches: int = 16           # M: occurrences of the longest matched tail that are scored
  max_siblings: int = 8       # G: sibling responses a row keeps (itself included)
  prior_acceptance: float = 0.5  # calibration factor before any feedback
  prior_strength: float = 4.0    # pseudo-nodes behind the prior

  def __post_init__(self):
    for name in ('chains', 'chain_depth', 'min_match', 'matches', 'max_siblings'):
      if getattr(self, name) < 1:
        raise ValueError(f'group drafts: {name} must be >= 1, got {getattr(self, name)}')
    if self.matches > 32:
      raise ValueError(f'group drafts: matches must be <= 32 (the ranking key is int32), '
                       f'got {self.matches}')
    if self.max_match < self.min_match:
      raise ValueError(f'group drafts: max_match ({self.max_match}) < min_match '
                       f'({self.min_match})')
    if not 0.0 < self.prior_acceptance <= 1.0 or self.prior_strength <= 0.0:
      raise ValueError('group drafts: prior_acceptance must be in (0, 1] and prior_strength > 0')


@struct.dataclass
class GroupBuffer:
  """A row's corpus sources; _GAP beyond each length."""
  prompt: jax.Array           # int32 [B, P] the row's prompt
  sibling_ids: jax.Array      # int32 [B, G] response ids of the row's siblings (-1: none)
  sibling_tokens: jax.Array   # int32 [B, G, T] their responses as last seen
  sibling_lengths: jax.Array  # int32 [B, G]

  def corpus(self) -> jax.Array:
    """int32 [B, P + 1 + G (T + 1)]: prompt, then each sibling, each followed by a _GAP."""
    batch, siblings, width = self.sibling_tokens.shape
    gap = jnp.full((batch, 1), _GAP, jnp.int32)
    responses = jnp.concatenate(
        [self.sibling_tokens, jnp.full((batch, siblings, 1), _GAP, jnp.int32)], axis=2)
    return jnp.concatenate([self.prompt, gap, responses.reshape(batch, -1)], axis=1)


@struct.dataclass
class GroupStats:
  """Per-row feedback on the chains (float32 [B] each)."""
  reached: jax.Array      # chain nodes (with a token) at a depth the walk drew under their path
  hits: jax.Array         # of those, nodes whose token the verifier drew
  predicted: jax.Array    # sum of the raw frequencies of the reached nodes
  tree_steps: jax.Array   # steps that asked for drafts
  matched: jax.Array      # of those, steps with at least one chain
  chain_tokens: jax.Array  # chain tokens offered
  accepted: jax.Array     # tokens the verifier accepted along a chain

  @classmethod
  def zeros(cls, batch: int) -> 'GroupStats':
    zero = jnp.zeros((batch,), jnp.float32)
    return cls(*(zero,) * 7)

  def calibration(self, config: GroupDraftConfig) -> jax.Array:
    """[B] drawn chain tokens per unit of predicted frequency, shrunk toward the prior."""
    strength = config.prior_strength
    return ((self.hits + strength * config.prior_acceptance)
            / (self.predicted + strength))


@struct.dataclass
class GroupState:
  base: Any  # the base proposer's state (None without a base)
  buffer: GroupBuffer
  stats: GroupStats


@struct.dataclass
class GroupRecord:
  base: Any             # the base proposal's record
  tokens: jax.Array     # int32 [B, K, D] chain tokens (0 where a chain has none)
  frequency: jax.Array  # float32 [B, K, D] raw frequency scores (0 where no token)
  buffer: GroupBuffer   # refreshed this step, kept by observe


@struct.dataclass
class GroupRowStats:
  base: Any
  group: GroupStats


def sibling_ids(prompt_tokens, prompt_lengths, response_ids, padding, max_siblings: int):
  """int32 [B, G]: response ids of the rows whose prompt equals the row's (itself included),
  in row order; -1 past the last. Padding rows have no siblings and are nobody's."""
  same = (jnp.all(prompt_tokens[:, None, :] == prompt_tokens[None, :, :], axis=-1)
          & (prompt_lengths[:, None] == prompt_lengths[None, :])
          & ~padding[:, None] & ~padding[None, :])
  batch = same.shape[0]
  # Earlier rows first: the key falls with the row index and is negative for non-siblings.
  keys = jnp.where(same, batch - jnp.arange(batch)[None, :], -1)
  width = min(max_siblings, batch)
  key, rows = jax.lax.top_k(keys, width)
  ids = jnp.where(key > 0, response_ids[rows], -1)
  return jnp.pad(ids, ((0, 0), (0, max_siblings - width)), constant_values=-1)


def refresh(buffer: GroupBuffer, seqs: Sequences) -> GroupBuffer:
  """The buffer with every sibling present in the batch read again from its row.

  A response id can sit in several rows (a batch's padding rows copy row 0's id), so the
  row with the most tokens is read; a sibling not in the batch keeps its last copy.
  """
  present = ((buffer.sibling_ids[:, :, None] == seqs.response_ids[None, None, :])
             & (buffer.sibling_ids[:, :, None] >= 0))
  length = jnp.where(present, seqs.num_generated[None, None, :], -1)
  row = jnp.argmax(length, axis=-1)  # [B, G]
  live_length = jnp.max(length, axis=-1)
  newer = live_length >= buffer.sibling_lengths
  live = seqs.tokens[row]  # [B, G, T]
  live = jnp.where(jnp.arange(live.shape[-1]) < live_length[..., None], live, _GAP)
  return buffer.replace(
      sibling_tokens=jnp.where(newer[..., None], live, buffer.sibling_tokens),
      sibling_lengths=jnp.where(newer, live_length, buffer.sibling_lengths))


def row_tail(prompt, prompt_lengths, seqs: Sequences, root, length: int) -> jax.Array:
  """int32 [B, length]: the row's text read backwards from this step's root (index 0), the
  response then the prompt; _BEFORE_TEXT past its start."""
  back = jnp.arange(length)[None, :] - 1  # tokens before the root: 0 = the last generated
  generated = seqs.num_generated[:, None]
  response_slot = generated - 1 - back
  prompt_slot = prompt_lengths[:, None] + response_slot
  rows = jnp.arange(root.shape[0])[:, None]
  from_response = seqs.tokens[rows, jnp.maximum(response_slot, 0)]
  from_prompt = prompt[rows, jnp.clip(prompt_slot, 0, prompt.shape[1] - 1)]
  text = jnp.where(response_slot >= 0, from_response,
                   jnp.where(prompt_slot >= 0, from_prompt, _BEFORE_TEXT))
  return jnp.where(back < 0, root[:, None], text)


def match_chains(config: GroupDraftConfig, corpus, tail):
  """(tokens int32 [B, K, D], frequency float32 [B, K, D]) of the chains that follow the
  most recent occurrences of the longest matching tail; 0 where a chain has no token."""
  batch, size = corpus.shape
  n, depth, m = config.max_match, config.chain_depth, min(config.matches, size)
  padded = jnp.concatenate([jnp.full((batch, n), _GAP, jnp.int32), corpus], axis=1)
  # equal[b, j, k]: corpus[j - k] == tail[k], i.e. the tail's k-th token back ends at j.
  equal = jnp.stack([padded[:, n - k:n - k + size] == tail[:, k:k + 1] for k in range(n)],
                    axis=-1)
  run = jnp.sum(jnp.cumprod(equal, axis=-1), axis=-1)  # [B, S] matched length ending at j
  following = jnp.concatenate([corpus[:, 1:], jnp.full((batch, 1), _GAP, jnp.int32)], axis=1)
  usable = (run >= config.min_match) & (following != _GAP)
  longest = jnp.max(jnp.where(usable, run, 0), axis=1)
  chosen = usable & (run == longest[:, None])
  position, order = jax.lax.top_k(jnp.where(chosen, jnp.arange(size)[None, :], -1), m)
  occurs = position >= 0  # [B, M]
  rows = jnp.arange(batch)[:, None, None]
  offsets = order[:, :, None] + 1 + jnp.arange(depth)[None, None, :]
  follow = corpus.at[rows, offsets].get(mode='fill', fill_value=_GAP)  # [B, M, D]
  has = jnp.cumprod((follow != _GAP) & occurs[..., None], axis=-1).astype(bool)
  agree = jnp.cumprod((follow[:, :, None, :] == follow[:, None, :, :])
                      & has[:, :, None, :] & has[:, None, :, :], axis=-1)  # [B, M, M, D]
  support = jnp.sum(agree, axis=2).astype(jnp.float32)  # occurrences sharing m's prefix to d
  occurrences = jnp.sum(occurs, axis=1).astype(jnp.float32)  # the support of depth 0's parent
  parent_support = jnp.concatenate(
      [jnp.broadcast_to(occurrences[:, None, None], (batch, m, 1)), support[:, :, :-1]], axis=2)
  frequency = jnp.where(has, support / jnp.maximum(parent_support, 1.0), 0.0)
  # Most supported first token, then second, third; then the most recent occurrence.
  count = support.astype(jnp.int32)
  rank = jnp.zeros((batch, m), jnp.int32)
  for level in range(min(depth, 3)):
    rank = rank * (m + 1) + count[:, :, level]
  rank = rank * (m + 1) ** (3 - min(depth, 3)) * size + position
  open_ = has[:, :, 0]
  tokens, scores = [], []
  for _ in range(config.chains):
    key = jnp.where(open_, rank, -1)
    pick = jnp.argmax(key, axis=1)
    found = jnp.max(key, axis=1) >= 0
    picked = lambda x: x[jnp.arange(batch), pick]
    chain_freq = jnp.where(found[:, None], picked(frequency), 0.0)
    tokens.append(jnp.where(chain_freq > 0, picked(follow), 0))
    scores.append(chain_freq)
    open_ = open_ & (follow[:, :, 0] != picked(follow)[:, None, 0])
  return jnp.stack(tokens, axis=1).astype(jnp.int32), jnp.stack(scores, axis=1)


def best_path_value(base: Candidates) -> jax.Array:
  """float32 [B, C]: the expected accepted tokens along the best path from each candidate
  down (its path score plus its best child's value, recursively; parents per row)."""
  path = base.along_paths(jnp.clip(base.scores, 0.0, 1.0), jnp.multiply, 1.0)
  parents, depth = base.parents(), base.depths
  rows = jnp.arange(path.shape[0])[:, None]
  best = path
  for d in range(int(depth.max(initial=1)), 1, -1):  # deepest children first
    at = np.flatnonzero(depth == d)
    below = jnp.zeros_like(best).at[rows, parents[:, at]].max(best[:, at])
    above = np.flatnonzero(depth == d - 1)
    best = best.at[:, above].set(path[:, above] + below[:, above])
  return best


def merge(chain_tokens, chain_scores, base: Candidates):
  """(chain scores, base scores) with no token path offered twice.

  Two sources propose the same path only if they agree on its first token, so duplicates
  are settled at depth 1: where a chain starts with the token of a depth-1 base candidate,
  the one whose best path below is worth more (expected accepted tokens) keeps its root and
  the other gets score 0 there, which takes its whole subtree out of the tree. (Each
  source's parents, static or per row, stay within it: one source's nodes cannot hang below
  the other's.)
  """
  roots = np.flatnonzero(np.asarray(base.parent) < 0)  # depth-1 base candidates
  chain_path = jnp.cumprod(jnp.clip(chain_scores, 0.0, 1.0), axis=-1)
  chain_value = jnp.sum(chain_path, axis=-1)  # [B, K]
  base_value = best_path_value(base)[:, roots]  # [B, R]
  same = ((chain_tokens[:, :, None, 0] == base.tokens[:, None, roots])
          & (chain_scores[:, :, None, 0] > 0) & (base.scores[:, None, roots] > 0))  # [B, K, R]
  chain_wins = chain_value[:, :, None] > base_value[:, None, :]
  chain_loses = jnp.any(same & ~chain_wins, axis=2)  # [B, K]
  base_loses = jnp.any(same & chain_wins, axis=1)    # [B, R]
  chain_scores = chain_scores.at[:, :, 0].set(jnp.where(chain_loses, 0.0, chain_scores[:, :, 0]))
  base_scores = base.scores.at[:, roots].set(jnp.where(base_loses, 0.0, base.scores[:, roots]))
  return chain_scores, base_scores


@dataclasses.dataclass(frozen=True)
class GroupProposer(Proposer):
  """Group drafts, merged with `base`'s candidates (None: group drafts alone)."""
  config: GroupDraftConfig
  base: Proposer | None = None

  @property
  def depth(self) -> int:
    return max(self.config.chain_depth, self.base.depth if self.base else 0)

  @property
  def num_candidates(self) -> int:
    chains = self.config.chains * self.config.chain_depth
    return chains + (self.base.num_candidates if self.base else 0)

  @property
  def feedback_top_m(self) -> int:
    return self.base.feedback_top_m if self.base else 0

  @property
  def feature_layers(self) -> tuple:
    return self.base.feature_layers if self.base else ()

  def _chain_parents(self) -> tuple:
    d = self.config.chain_depth
    return tuple(-1 if i == 0 else c * d + i - 1 for c in range(self.config.chains)
                 for i in range(d))

  def init(self, prompt_tokens, seqs: Sequences) -> GroupState:
    batch, width = seqs.tokens.shape
    g = self.config.max_siblings
    prompt = jnp.where(jnp.arange(prompt_tokens.shape[1])[None, :] < seqs.prompt_lengths[:, None],
                       prompt_tokens.astype(jnp.int32), _GAP)
    buffer = GroupBuffer(
        prompt=prompt,
        sibling_ids=sibling_ids(prompt, seqs.prompt_lengths, seqs.response_ids, seqs.done, g),
        sibling_tokens=jnp.full((batch, g, width), _GAP, jnp.int32),
        sibling_lengths=jnp.zeros((batch, g), jnp.int32))
    base = self.base.init(prompt_tokens, seqs) if self.base else None
    return GroupState(base=base, buffer=buffer, stats=GroupStats.zeros(batch))

  def propose(self, params, state: GroupState, context: StepContext, levels: int) -> Proposal:
    c = self.config
    buffer = refresh(state.buffer, context.seqs)
    tail = row_tail(buffer.prompt, context.seqs.prompt_lengths, context.seqs, context.root,
                    c.max_match)
    tokens, frequency = match_chains(c, buffer.corpus(), tail)
    scores = jnp.clip(frequency * state.stats.calibration(c)[:, None, None], 0.0, 1.0)
    batch = tokens.shape[0]
    base_record = None
    if self.base:
      inner = self.base.propose(params, state.base, context, min(levels, self.base.depth))
      scores, base_scores = merge(tokens, scores, inner.candidates)
      base_candidates = inner.candidates.replace(scores=base_scores)
      base_record = inner.record
    chains = Candidates(tokens=tokens.reshape(batch, -1), scores=scores.reshape(batch, -1),
                        parent=self._chain_parents())
    candidates = chains.concat(base_candidates) if self.base else chains
    return Proposal(candidates=candidates,
                    record=GroupRecord(base=base_record, tokens=tokens, frequency=frequency,
                                       buffer=buffer))

  def observe(self, params, state: GroupState, context, proposal: Proposal,
              feedback: Feedback) -> GroupState:
    record, d = proposal.record, self.config.chain_depth
    running = (~context.seqs.done).astype(jnp.float32)
    drew = feedback.in_tree[:, :d]
    drawn = feedback.drawn[:, None, :d]
    offered = record.frequency > 0
    on_path = jnp.cumprod((record.tokens == drawn) & drew[:, None, :], axis=-1)  # [B, K, D]
    under_path = jnp.concatenate([jnp.ones_like(on_path[..., :1]), on_path[..., :-1]], axis=-1)
    reached = offered & drew[:, None, :] & under_path.astype(bool)
    hit = reached & on_path.astype(bool)
    along = jnp.max(jnp.sum(on_path * offered, axis=-1), axis=1)
    s = state.stats
    stats = GroupStats(
        reached=s.reached + jnp.sum(reached, axis=(1, 2)),
        hits=s.hits + jnp.sum(hit, axis=(1, 2)),
        predicted=s.predicted + jnp.sum(jnp.where(reached, record.frequency, 0.0), axis=(1, 2)),
        tree_steps=s.tree_steps + running,
        matched=s.matched + running * jnp.any(offered[:, :, 0], axis=1),
        chain_tokens=s.chain_tokens + running * jnp.sum(offered, axis=(1, 2)),
        accepted=s.accepted + running * jnp.minimum(along, feedback.accepted))
    base = state.base
    if self.base:
      inner = Proposal(candidates=None, record=record.base)
      base = self.base.observe(params, state.base, context, inner,
                               feedback.first_levels(self.base.depth))
    return GroupState(base=base, buffer=record.buffer, stats=stats)

  def row_stats(self, state: GroupState) -> GroupRowStats:
    return GroupRowStats(base=self.base.row_stats(state.base) if self.base else None,
                         group=state.stats)

  def head_stats(self, stats: GroupRowStats):
    """The heads' statistics of the base (what the slow path reads)."""
    return self.base.head_stats(stats.base)

  def summarize(self, stats: list, steps: list) -> dict:
    """Chain acceptance (drawn / reached chain nodes), the share of tree steps with a match,
    chain tokens per matched step, tokens accepted along chains per tree step, and the
    base's own summaries."""
    total = lambda name: float(np.sum([getattr(s.group, name) for s in stats]))
    out = {
        'group_acceptance': total('hits') / max(total('reached'), 1.0),
        'group_calibration': (total('hits') / max(total('predicted'), 1e-9)),
        'group_match_rate': total('matched') / max(total('tree_steps'), 1.0),
        'group_chain_tokens': total('chain_tokens') / max(total('matched'), 1.0),
        'group_accepted_per_tree_step': total('accepted') / max(total('tree_steps'), 1.0)}
    out = {k: round(v, 4) for k, v in out.items()}
    if self.base:
      out.update(self.base.summarize([s.base for s in stats], steps))
    return out

