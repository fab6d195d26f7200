"""The sequential drafter as a proposer: a tree of rank paths, static or grown per row, one
depth at a time.

The candidates are a prefix-closed set of rank paths (r_1, ..., r_d): the candidate (r_1..r_d)
is the rank-r_d token of the drafter's law after the path (r_1..r_{d-1}). Each candidate with
children costs one block step, z = f(z_parent, e(its token)), and one projection; the root's
state is f(h_t, e(root)). All expanded candidates of a depth run as one batch of block steps,
so a tree step runs `levels` batched block steps and projections; their rows grow with the
expanded candidates (SmolLM2, one response: 0.10 plain steps to propose the 18-candidate
spine, 0.21 for a 48-candidate tree; results/drafts_w3).

The spine (`spine_paths`) hangs each depth's top-k below the previous depth's best guess:
one block step per depth, the cheapest tree. At T = 1 the best guess carries ~0.3 of the
policy's mass on SmolLM2 (notes/history.md, issue 29), so most accepted paths leave the spine
after their first step; a tree chosen from the drafter's own held-out rank paths
(experiments.measure.drafter_trees) expands the lower ranks that are drawn often enough.
That shape is static, the same in every row and position.

A tree grown best-first (`expanded`, EAGLE-2's dynamic tree) expands instead, at each depth,
the `expanded[d]` candidates of the highest path probability under the drafter in this row
at this position, each with the spine's width of children: which rank paths are expanded
differs per row, so its candidates carry per-row parents (Candidates.row_parents); the
number of expanded candidates per depth, and so the cost and the shapes, stay static. With
one expanded candidate per depth it is the spine. Where the drafter's law is peaked, the
best paths run deep along one guess; where it is flat, they spread over its top ranks.

An edge's score is the drafter's own probability of the token under the sampler: the
drafter is trained to match the policy's distribution at that position, so it is the
estimated chance that the verifier draws it. Per-(depth, rank) verifier statistics are kept
per row (DepthStats, for reports) along the first expanded candidate of each depth (the
spine's best-guess path; in a grown tree the row's most probable path, which moves per row
and step); the heads' scores blend in those online rates because heads that
cannot see the root are miscalibrated by construction, the drafter's are not.

Reflex does not apply: it corrects a head's output for a fixed horizon from delayed
feedback, while the drafter's depth-d state depends on the tokens drafted before it, so a
correction learned for one draft path does not carry to the next step's. The slow path
trains the drafter's block on the learner's harvested pairs with its own loss
(adapt/drafter_consolidation.py, rl/drafter_adaptation.py), watching these per-depth
statistics as it watches the heads'.
"""
import dataclasses
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np

from specroll_jax.model.config import ModelConfig
from specroll_jax.rollout import sampling
from specroll_jax.speculative.drafter import DrafterConfig, DrafterParams, drafter_step
from specroll_jax.speculative.head_proposer import DepthStats, HeadGuesses
from specroll_jax.speculative.proposer import Candidates, Feedback, Proposal, Proposer, StepContext


def spine_paths(branching) -> tuple:
  """The spine's rank paths: depth d's top branching[d-1] below depth d-1's best guess."""
  return tuple((0,) * d + (r,) for d, width in enumerate(branching) for r in range(width))


@dataclasses.dataclass(frozen=True)
class TreeLayout:
  """Static index arrays of a rank-path tree (numpy: constants in every trace)."""
  paths: tuple          # [C] rank paths, shallower first (parents before children)
  parent: tuple         # [C] parent candidate, -1 below the root
  expanded: tuple       # [depth] per depth d >= 1, the candidates of depth d with children
  slot: np.ndarray      # [C] index of the candidate's parent among its depth's expanded ones
  rank: np.ndarray      # [C] rank of the candidate in its parent's law
  depth: np.ndarray     # [C] 1..depth
  top_k: np.ndarray     # [depth] ranks read from each depth's laws (max rank + 1)
  # [depth] per depth d >= 1, the slot of each expanded candidate's parent at depth d - 1.
  expanded_slot: tuple

  @classmethod
  def build(cls, paths) -> 'TreeLayout':
    paths = tuple(sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p)))
    if not paths or min(map(len, paths)) < 1 or min(min(p) for p in paths) < 0:
      raise ValueError(f'a drafter tree needs non-empty rank paths of ranks >= 0, got {paths}')
    index = {p: i for i, p in enumerate(paths)}
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in index]
    if missing:
      raise ValueError(f'drafter tree paths are not prefix-closed: {missing[0]} has no parent')
    depth = max(map(len, paths))
    parents_of = {p[:-1] for p in paths if len(p) > 1}
    expanded = tuple(tuple(i for i, p in enumerate(paths) if len(p) == d and p in parents_of)
                     for d in range(1, depth))
    slot_of = {(): 0}
    for level in expanded:
      slot_of.update({paths[i]: s for s, i in enumerate(level)})
    return cls(
        paths=paths, parent=tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths),
        expanded=expanded, slot=np.array([slot_of[p[:-1]] for p in paths], np.int32),
        rank=np.array([p[-1] for p in paths], np.int32),
        depth=np.array([len(p) for p in paths], np.int32),
        top_k=np.array([1 + max(p[-1] for p in paths if len(p) == d)
                        for d in range(1, depth + 1)], np.int32),
        expanded_slot=tuple(np.array([slot_of[paths[i][:-1]] for i in level], np.int32)
                            for level in expanded))


def best_first_counts(widths: tuple, expanded: tuple) -> tuple:
  """Candidates per depth of a tree grown best-first from the spine of `widths`: depth 1's
  widths[0], then depth d's expanded[d - 2] nodes x widths[d - 1] children each."""
  counts = [widths[0]]
  for e, k in zip(expanded, widths[1:]):
    if not 1 <= e <= counts[-1]:
      break
    counts.append(e * k)
  if len(expanded) != len(widths) - 1 or len(counts) != len(widths):
    raise ValueError(f'expanded={tuple(expanded)}: one count per depth above the deepest '
                     f'({len(widths) - 1} for widths {tuple(widths)}), each between 1 and the '
                     f'candidates of its depth')
  return tuple(counts)


def take_slots(x, slots):
  """x [B, S, ...] at slots -> [B, E, ...]: static slots [E] (numpy, a static tree's: a
  static slice) or per-row slots [B, E] (a grown tree's: a gather)."""
  if isinstance(slots, np.ndarray):
    return x[:, slots]
  return x[jnp.arange(x.shape[0])[:, None], slots]


@dataclasses.dataclass(frozen=True)
class DrafterProposer(Proposer):
  model_config: ModelConfig
  config: DrafterConfig
  paths: tuple  # the tree's rank paths (spine_paths for the spine)
  sampler: sampling.SamplerConfig
  # Per depth d < depth: how many of depth d's candidates each row expands, those of the
  # highest path probability under the drafter (EAGLE-2's dynamic tree; `paths` must then be
  # a spine, whose depth-d width is each expanded candidate's children). (): static `paths`.
  expanded: tuple = ()

  def __post_init__(self):
    layout = TreeLayout.build(self.paths)
    object.__setattr__(self, 'paths', layout.paths)
    object.__setattr__(self, 'expanded', tuple(int(e) for e in self.expanded))
    if int(layout.depth.max()) > self.config.depth:
      raise ValueError(f'tree depth {int(layout.depth.max())} exceeds the drafter\'s trained '
                       f'depth {self.config.depth}')
    if self.expanded:
      widths = tuple(int(k) for k in layout.top_k)
      if layout.paths != spine_paths(widths):
        raise ValueError(f'a best-first drafter tree grows from a spine; paths {layout.paths} '
                         f'are not spine_paths({widths})')
      best_first_counts(widths, self.expanded)

  @cached_property
  def layout(self) -> TreeLayout:
    return TreeLayout.build(self.paths)

  @property
  def level_counts(self) -> tuple:
    """Candidates per depth."""
    if not self.expanded:
      return tuple(int(n) for n in np.bincount(self.layout.depth)[1:])
    return best_first_counts(tuple(int(k) for k in self.layout.top_k), self.expanded)

  @property
  def depth(self) -> int:
    return int(self.layout.depth.max())

  @property
  def feature_layers(self) -> tuple:
    return self.config.feature_layers

  @property
  def num_candidates(self) -> int:
    return sum(self.level_counts)

  def init(self, prompt_tokens, seqs) -> DepthStats:
    del prompt_tokens
    return DepthStats.zeros(seqs.done.shape[0], self.depth, int(self.layout.top_k.max()))

  def _expand(self, d: int, law, path):
    """Depth d + 1's expanded candidates, from depth d + 1's laws (ids, probs [B, E_d, k])
    and their parents' path probabilities [B, E_d]: (the slots of their parents: static [E]
    in a static tree, [B, E] in a grown one; their tokens [B, E]; in a grown tree their path
    probabilities [B, E] and their indices [B, E] among depth d + 1's candidates, the laws
    flattened; a static tree passes `path` through and has no indices)."""
    ids, p = law
    batch = ids.shape[0]
    if not self.expanded:
      layout = self.layout
      slots = layout.expanded_slot[d]
      return slots, ids[:, slots, layout.rank[np.asarray(layout.expanded[d])]], path, None
    path, flat = jax.lax.top_k((path[:, :, None] * p).reshape(batch, -1), self.expanded[d])
    tokens = jnp.take_along_axis(ids.reshape(batch, -1), flat, axis=1)
    return flat // p.shape[-1], tokens, path, flat

  def _laws(self, params: DrafterParams, context: StepContext, levels: int, first, advance):
    """Per depth d <= levels, the top tokens and probabilities of the laws of depth d - 1's
    expanded candidates (the root's at depth 1): ([B, E_{d-1}, k_d] ids, probs), best
    expanded candidate first; and per depth d < levels, the indices [B, E_d] of depth d's
    expanded candidates among its candidates (laws flattened; None in a static tree).

    first() -> the root's state [B, 1, D]; advance(depth, parent_slots, tokens, z) -> the
    states [B, E, D] of depth's expanded candidates `tokens` [B, E], whose parents sit at
    `parent_slots` (static [E] or per-row [B, E], see take_slots) of the previous depth's
    states `z`.
    """
    layout, draft_rows = self.layout, context.vocab.rows(params.vocab_ids)  # [V_d, D]
    z = first()
    path = jnp.ones(z.shape[:2], jnp.float32)
    laws, expanded_index, depths = [], [], min(levels, self.depth)
    for d in range(depths):
      k = int(layout.top_k[d])
      p, index = jax.lax.top_k(sampling.distribution(z @ draft_rows.T, self.sampler), k)
      laws.append((params.vocab_ids[index], p))
      if d + 1 == depths:
        break
      # Prefix-closed paths: every depth above the deepest has candidates with children.
      slots, tokens, path, flat = self._expand(d, laws[d], path)
      expanded_index.append(flat)
      z = advance(d + 2, slots, tokens, z)
    return laws, expanded_index

  def propose(self, params: DrafterParams, state: DepthStats, context: StepContext,
              levels: int) -> Proposal:
    del state
    step = lambda z, tokens: drafter_step(self.config, self.model_config, params.weights, z,
                                          context.vocab.embed(tokens))
    laws, expanded_index = self._laws(
        params, context, levels, first=lambda: step(self.config.first_state(
            self.model_config, params.weights, context.features), context.root)[:, None],
        advance=lambda depth, slots, tokens, z: step(take_slots(z, slots), tokens))
    candidates, guesses = self.candidates(laws, expanded_index, context)
    return Proposal(candidates=candidates, record=guesses)

  def candidates(self, laws, expanded_index, context: StepContext) -> tuple:
    """(Candidates, HeadGuesses along the first expanded candidates) from each depth's laws
    and expanded candidates (as `_laws` returns them)."""
    batch = context.root.shape[0]
    tokens, scores, row_parents = self._static_candidates(laws, batch) if not self.expanded \
        else self._best_first_candidates(laws, expanded_index, batch)
    top_k = int(self.layout.top_k.max())
    first_tokens, first_probs = [], []
    for ids, p in laws:
      pad = ((0, 0), (0, top_k - ids.shape[-1]))
      first_tokens.append(jnp.pad(ids[:, 0], pad))
      first_probs.append(jnp.pad(p[:, 0], pad))
    rows = lambda x: jnp.pad(jnp.stack(x, axis=1), ((0, 0), (0, self.depth - len(laws)), (0, 0)))
    proposed = ~context.seqs.done[:, None] & (jnp.arange(self.depth) < len(laws))[None, :]
    guesses = HeadGuesses(tokens=rows(first_tokens), probs=rows(first_probs), proposed=proposed)
    return Candidates(tokens=tokens, scores=scores, parent=self.template_parents,
                      row_parents=row_parents), guesses

  @cached_property
  def template_parents(self) -> tuple:
    """Static parents: the rank paths', or in a best-first tree each candidate's parent slot
    read as that depth's candidate of the same index (a row's parents are its own)."""
    if not self.expanded:
      return self.layout.parent
    counts, widths = self.level_counts, self.layout.top_k
    offsets = np.cumsum((0,) + counts)
    return tuple(-1 if d == 0 else int(offsets[d - 1] + c // widths[d])
                 for d, n in enumerate(counts) for c in range(n))

  def _static_candidates(self, laws, batch: int):
    layout = self.layout
    tokens = jnp.zeros((batch, self.num_candidates), jnp.int32)
    scores = jnp.zeros((batch, self.num_candidates), jnp.float32)
    for d, (ids, p) in enumerate(laws, start=1):
      at = np.flatnonzero(layout.depth == d)
      tokens = tokens.at[:, at].set(ids[:, layout.slot[at], layout.rank[at]])
      scores = scores.at[:, at].set(p[:, layout.slot[at], layout.rank[at]])
    return tokens, scores, None

  def _best_first_candidates(self, laws, expanded_index, batch: int):
    """Depth d's candidates are its laws flattened (expanded slot, rank); each row's parent
    of one is the candidate its slot expanded at depth d - 1. Depths below this step's
    levels keep score 0 and their template parents."""
    offsets = np.cumsum((0,) + self.level_counts)
    tokens = [ids.reshape(batch, -1) for ids, _ in laws]
    scores = [p.reshape(batch, -1) for _, p in laws]
    parents = [jnp.full((batch, self.level_counts[0]), -1, jnp.int32)]
    for d, flat in enumerate(expanded_index, start=1):
      parents.append(jnp.repeat(flat + int(offsets[d - 1]), int(self.layout.top_k[d]), axis=1))
    missing = self.num_candidates - int(offsets[len(laws)])
    template = jnp.asarray(self.template_parents[int(offsets[len(laws)]):], jnp.int32)
    pad = lambda parts, fill, dtype: jnp.concatenate(
        parts + [jnp.broadcast_to(jnp.asarray(fill, dtype), (batch, missing))], axis=1)
    return (pad(tokens, 0, jnp.int32), pad(scores, 0.0, jnp.float32),
            pad(parents, template, jnp.int32))

  def observe(self, params, state: DepthStats, context, proposal: Proposal,
              feedback: Feedback) -> DepthStats:
    del params, context
    return state.record(proposal.record, feedback, tuple(int(k) for k in self.layout.top_k))

  def row_stats(self, state: DepthStats) -> DepthStats:
    return state

  def head_stats(self, stats: DepthStats) -> DepthStats:
    """Per-depth statistics along the first expanded candidates (what the slow path reads)."""
    return stats
