"""The speculative engine: a proposer drafts, a sparse tree is verified in one policy forward.

One step per running row (METHOD.md section 2): draw the root from the policy's
distribution at the last verified position; the proposer (speculative/proposer.py) drafts
candidates; a concurrency-aware tree of N_t nodes (tree.py) runs through the policy with
tree attention (ancestor mask, positions = prefix length + depth); sample-and-match
(verify.py) accepts a path; the path's keys/values are committed to the cache at each row's
own length, its last node seeds the next step, and the proposer observes the verifier's
feedback. Exactness does not depend on the proposer: bad drafts only lower tokens per forward.
Where a tree cannot pay for itself (one node per row, or the speculation gate's estimate
against the measured cost of a tree step, speculative/gate.py) the step is the vanilla step itself.
"""
import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from specroll_jax.model.attention import attention_implementation
from specroll_jax.model.config import ModelConfig
from specroll_jax.model.kv_cache import KVCache, commit
from specroll_jax.model.mesh import constrain_rows
from specroll_jax.model.prefill import prefill
from specroll_jax.model.transformer import (Transformer, apply_with_features, compute_params,
                                            final_hidden)
from specroll_jax.rollout import response, sampling
from specroll_jax.rollout.engine import Engine
from specroll_jax.rollout.sequences import Sequences
from specroll_jax.rollout.vanilla import decode_one
from specroll_jax.speculative import gate
from specroll_jax.speculative.proposer import Feedback, Proposer, StepContext, Vocabulary
from specroll_jax.speculative.tree import TreeConfig, build_tree
from specroll_jax.speculative.verify import walk


@struct.dataclass
class SpecParams:
  """What the engine reads but never changes."""
  policy: dict
  proposer: Any  # the proposer's parameters (the heads, or the oracle's OracleParams)


@struct.dataclass
class TreeStats:
  """Per-row statistics of the trees and walks, whatever proposed them."""
  reached: jax.Array   # float32 [B, H] draws at depth d where the tree had candidates
  accepted: jax.Array  # float32 [B, H] accepted nodes at depth d
  nodes: jax.Array     # float32 [B] tree nodes verified (the budget summed over steps)

  @classmethod
  def zeros(cls, batch: int, depth: int) -> 'TreeStats':
    return cls(reached=jnp.zeros((batch, depth)), accepted=jnp.zeros((batch, depth)),
               nodes=jnp.zeros((batch,)))

  def record(self, feedback: Feedback, budget, running) -> 'TreeStats':
    live = running.astype(jnp.float32)
    depth_index = jnp.arange(1, self.accepted.shape[1] + 1)[None, :]
    return TreeStats(reached=self.reached + feedback.in_tree,
                     accepted=self.accepted + live[:, None] * (depth_index
                                                               <= feedback.accepted[:, None]),
                     nodes=self.nodes + live * budget)

  def record_plain(self, running) -> 'TreeStats':
    return self.replace(nodes=self.nodes + running.astype(jnp.float32))


@struct.dataclass
class SpecRowStats:
  """Response.stats of a speculative rollout."""
  tree: TreeStats
  proposer: Any  # the proposer's row_stats
  gate: gate.GateState  # its tree_steps: the steps that verified a tree (the rest were plain)


@struct.dataclass
class SpecState:
  cache: KVCache
  next_logits: jax.Array   # float32 [B, V] policy logits for each row's next token
  # [B, (1 + L) D] at each row's last verified position: the policy's hidden state, then
  # the outputs of the proposer's feature layers (StepContext.features)
  last_features: jax.Array
  seqs: Sequences
  tree_stats: TreeStats
  proposer: Any            # the proposer's per-row state
  gate: gate.GateState


@dataclasses.dataclass(frozen=True)
class SpecEngine(Engine):
  model_config: ModelConfig
  proposer: Proposer
  tree_config: TreeConfig
  sampler: sampling.SamplerConfig
  eos_ids: tuple
  mesh: Mesh | None = None
  tree_attention: str = 'xla'  # attention for the tree forward (model/attention.py)
  # ((batch, cost of a tree step in plain steps), ...) ascending, from
  # speculative.step_cost.measure_step_costs; empty: no gate, every step of width > 1 is a tree.
  tree_step_costs: tuple = ()
  gate_config: gate.GateConfig = gate.GateConfig()

  @property
  def model(self) -> Transformer:
    return Transformer(self.model_config)

  @property
  def top_m(self) -> int:
    """M: the policy's top tokens the walk keeps at each draw, as many as the proposer
    reads (0: no softmax or top-k over the vocabulary in the walk)."""
    return min(self.proposer.feedback_top_m, self.model_config.vocab_size)

  def params(self, policy_params, proposer_params) -> SpecParams:
    return SpecParams(policy=compute_params(self.model_config, policy_params),
                      proposer=proposer_params)

  def tree_width(self, batch: int) -> int:
    """Static node slots for a batch bucket: its sized width, else the budget of a full
    bucket, C_hw(B) // B; never more than the proposer can fill.

    Sizing for a full bucket means no slot is computed and left empty when the segment
    starts; as rows finish inside the segment the budget stays capped at this width until
    the driver compacts the batch, and the next bucket's trees are twice as wide.
    """
    return min(self.tree_config.width(batch), 1 + self.proposer.num_candidates)

  def tree_levels(self, batch: int) -> int:
    """Depths a bucket's tree reaches: a tree of N slots never reaches below depth N - 1."""
    return min(self.proposer.depth, self.tree_width(batch) - 1)

  def tree_step_cost(self, batch: int) -> float | None:
    """The measured cost of a tree step at this bucket: that of the nearest measured batch
    at or above it (the largest measured one beyond the table); None without a table."""
    if not self.tree_step_costs:
      return None
    return next((cost for b, cost in self.tree_step_costs if b >= batch),
                self.tree_step_costs[-1][1])

  @partial(jax.jit, static_argnums=(0, 4))
  def start(self, params: SpecParams, prompt_tokens, seqs: Sequences, cache_length: int):
    cache, features, logits = prefill(self.model, params.policy, prompt_tokens,
                                      seqs.prompt_lengths, cache_length,
                                      self.proposer.feature_layers)
    batch = prompt_tokens.shape[0]
    # A row carries one response for its whole life, so proposer state starts fresh per response.
    state = SpecState(cache=cache, next_logits=logits, last_features=features, seqs=seqs,
                      tree_stats=TreeStats.zeros(batch, self.proposer.depth),
                      proposer=self.proposer.init(prompt_tokens, seqs),
                      gate=gate.GateState.init(self.gate_config, batch))
    return constrain_rows(self.mesh, state)

  def step(self, params: SpecParams, state: SpecState, seed_key) -> SpecState:
    """One policy forward per row: a tree, or the plain step where a batch's budget is one
    node per row."""
    if self.tree_width(state.seqs.done.shape[0]) == 1:
      return self.plain_step(params, state, seed_key)
    return self.tree_step(params, state, seed_key)

  def advance(self, params: SpecParams, state: SpecState, seed_key, keep_going) -> SpecState:
    """With a gate: tree steps while they pay, then plain steps until a tree would pay again
    (a probe is due, or the estimate has moved): each step's kind is `tree_pays` there.

    Two while loops one after the other, not a `lax.cond` between two segments: with the
    cond, XLA:CPU copied the cache layers in the loops inside its branches on every step
    (the compiled W1 loop held 24 copies of [B, KVH, S, Dh] layers, now 6, the same as the
    engine without a gate), and the main job's gated rollouts ran at 0.78x of vanilla with
    3.7% tree steps; with the two loops, 0.97x (experiments.bench.rollout_variants). Either
    loop may run no step; one of them always runs at least one, since a step either pays
    or does not.
    """
    batch = state.seqs.done.shape[0]
    cost = self.tree_step_cost(batch)
    if self.tree_width(batch) == 1 or cost is None:
      return self.step(params, state, seed_key)
    levels = self.tree_levels(batch)
    pays = lambda s: gate.tree_pays(self.gate_config, s.gate, ~s.seqs.done, cost, levels)
    with jax.named_scope('gate'):
      state = jax.lax.while_loop(lambda s: keep_going(s) & pays(s),
                                 lambda s: self.tree_step(params, s, seed_key), state)
      return jax.lax.while_loop(lambda s: keep_going(s) & ~pays(s),
                                lambda s: self.plain_step(params, s, seed_key), state)

  def tree_step(self, params: SpecParams, state: SpecState, seed_key) -> SpecState:
    """One speculative step; each stage is a named scope (experiments.profile.step's rows)."""
    seqs, tc, depth = state.seqs, self.tree_config, self.proposer.depth
    batch, running = seqs.done.shape[0], ~seqs.done
    width, levels = self.tree_width(batch), self.tree_levels(batch)
    positions = seqs.next_positions
    with jax.named_scope('root_draw'):
      root, root_logprob = sampling.draw_next(state.next_logits, seed_key, seqs.response_ids,
                                              positions, self.sampler)
    context = StepContext(state.last_features, root, seqs,
                          Vocabulary(params.policy, self.model_config))
    with jax.named_scope('propose'):
      proposal = self.proposer.propose(params.proposer, state.proposer, context, levels)
    with jax.named_scope('build_tree'):
      budget = tc.bucket_budget(batch, jnp.sum(running), width)
      tree = build_tree(root, proposal.candidates, jnp.full((batch,), budget, jnp.int32),
                        width, depth)
    with jax.named_scope('verify_forward'):
      features, block = self._verify_forward(params.policy, tree, positions, state.cache)
    with jax.named_scope('walk'):
      hidden = final_hidden(self.model_config, features)
      result = walk(tree, self._node_logits(context.vocab, hidden), seed_key, seqs.response_ids,
                    positions, self.sampler, depth, self.model_config.vocab_size, self.top_m)
    with jax.named_scope('commit'):
      seqs, kept = seqs.append(result.tokens, jnp.concatenate([root_logprob[:, None],
                                                               result.logprobs], axis=1),
                               result.accepted + 1, self.eos_ids)
      cache = commit(state.cache, block, result.path, kept)
    feedback = result.feedback(running, levels, features)
    with jax.named_scope('statistics'):
      tree_stats = state.tree_stats.record(feedback, budget, running)
      cost = self.tree_step_cost(batch)  # None: no gate, so every tree counts as paying
      gate_state = gate.after_tree(self.gate_config, state.gate, result.accepted, running,
                                   0.0 if cost is None else cost, levels)
    with jax.named_scope('observe'):
      proposer_state = self.proposer.observe(params.proposer, state.proposer, context,
                                             proposal, feedback)
    return constrain_rows(self.mesh, SpecState(
        cache=cache, next_logits=result.last_logits, last_features=result.at_last_node(features),
        seqs=seqs, tree_stats=tree_stats, proposer=proposer_state, gate=gate_state))

  def plain_step(self, params: SpecParams, state: SpecState, seed_key) -> SpecState:
    """The vanilla step (the same draw, one-token forward and projection, so it costs what
    vanilla's does and emits the same bits), for a batch whose budget is one node per row
    or whose trees the gate expects not to pay. The proposer is not consulted; its state is
    carried unchanged, so feedback on proposals made before stops (Reflex's pending
    sketches for these positions never mature)."""
    running = ~state.seqs.done
    features, cache, logits, seqs = decode_one(self.model, params.policy, state.cache,
                                               state.next_logits, state.seqs, seed_key,
                                               self.sampler, self.eos_ids,
                                               self.proposer.feature_layers)
    return constrain_rows(self.mesh, state.replace(
        cache=cache, next_logits=logits, last_features=features, seqs=seqs,
        tree_stats=state.tree_stats.record_plain(running),
        gate=gate.after_plain(state.gate, running)))

  def _node_logits(self, vocab: Vocabulary, hidden):
    """The walk's logits at a node per row, from the tree forward's hidden [B, N, D]: one
    projection of every node where this bucket was measured to walk faster that way (one
    read of the embedding instead of one per depth reached), else one per depth."""
    batch, width, _ = hidden.shape
    rows = jnp.arange(batch)
    if self.tree_config.projects_all_nodes(batch):
      every = vocab.logits(hidden.reshape(batch * width, -1)).reshape(batch, width, -1)
      return lambda current: every[rows, current]
    return lambda current: vocab.logits(hidden[rows, current])

  def _verify_forward(self, policy_params, tree, positions, cache):
    """Every tree node through the policy at once: positions = prefix length + depth, each
    node attending to the cached prefix and its own ancestors. Returns (features [B, N, F]:
    the hidden states, then the proposer's feature layers' outputs; the block's keys and
    values)."""
    verifier = Transformer(self.model_config, attention_implementation(self.tree_attention))
    return apply_with_features(verifier, policy_params, self.proposer.feature_layers,
                               tree.tokens, positions[:, None] + tree.depths,
                               tree.ancestor_mask(self.proposer.depth), cache)

  def row_stats(self, state: SpecState) -> SpecRowStats:
    return SpecRowStats(tree=state.tree_stats, proposer=self.proposer.row_stats(state.proposer),
                        gate=state.gate)

  def summarize(self, responses) -> dict:
    """tau, acceptance by depth (accepted / drawn where the tree reached), mean tree size,
    and the proposer's own summaries."""
    summary = response.summarize(responses)
    if not responses:
      return summary
    total = lambda name: np.sum([getattr(r.stats.tree, name) for r in responses], axis=0)
    accepted, reached = total('accepted'), total('reached')
    summary.update(
        acceptance_by_depth=(accepted / np.maximum(reached, 1)).round(4).tolist(),
        accepted_by_depth=accepted.astype(int).tolist(),
        mean_tree_nodes=float(total('nodes')) / max(summary['row_forwards'], 1),
        tree_step_share=float(np.sum([r.stats.gate.tree_steps for r in responses]))
        / max(summary['row_forwards'], 1))
    summary.update(self.proposer.summarize([r.stats.proposer for r in responses],
                                           [r.steps for r in responses]))
    return summary
