"""The context-attending drafter as a proposer: the sequential drafter's trees, with a per-row
cache of the drafter's own keys and values over the response so far.

Drafting is the sequential drafter's (drafter_proposer.py: a tree of rank paths, static or
grown best-first per row, one batched layer call per depth), with the layer of
context_drafter.py: each depth's expanded candidates attend to the row's cache and to their
own chain of ancestors' keys (gathered per row, since a grown tree's parents are per row).

The cache holds one entry per response position j < n (n = tokens generated so far), the
keys and values of u_j = F(h_j, e(x_{j+1})); entry j sits at slot j, so a row's cache is as
long as its longest response (the driver's bucket of max_new_tokens) and compacts with the
batch like any per-row state. A tree step writes entries n .. n + a (a = accepted nodes):
entry n from this step's root state (the last verified h_n and the drawn root), entries
n + i from the verifier's hidden states along the accepted path (Feedback.path_features)
and the accepted tokens, so nothing from a rejected node enters the cache. A plain step
(one node per row, or the gate's choice) does not consult the proposer: its positions stay
empty and are masked out, so later drafts see fewer earlier entries, never wrong ones. So do
the positions of a path that group drafts (group_proposer.py) accepted below this drafter's
depth: its feedback is cut at its own depth.

With `feature_layers`, h_n and the path's states are fused with those layers' outputs
(`first_state`), read from the step's captured features.

Reflex does not apply, for the sequential drafter's reason (drafter_proposer.py). The slow
path trains the layer (and its fusion) on the learner's harvested pairs with the sequential
drafter's loss (adapt/drafter_training.py unrolls any drafter kind; rl/drafter_adaptation.py,
ContextDrafterKind).
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from specroll_jax.speculative.context_drafter import Layer
from specroll_jax.speculative.drafter import DrafterParams
from specroll_jax.speculative.drafter_proposer import DrafterProposer, take_slots
from specroll_jax.speculative.head_proposer import DepthStats, HeadGuesses
from specroll_jax.speculative.proposer import Feedback, Proposal, StepContext


@struct.dataclass
class ContextCache:
  """A row's drafter entries by response position, and its depth statistics."""
  keys: jax.Array    # [B, S, H, Dh] rotated keys of entry j at slot j
  values: jax.Array  # [B, S, H, Dh]
  filled: jax.Array  # bool [B, S] entry j was written (a tree step covered position j)
  stats: DepthStats


@struct.dataclass
class ContextRecord:
  guesses: HeadGuesses
  root_key: jax.Array    # [B, H, Dh] entry n's key and value, computed while drafting
  root_value: jax.Array


@dataclasses.dataclass(frozen=True)
class ContextDrafterProposer(DrafterProposer):
  """`config` is a ContextDrafterConfig."""

  def init(self, prompt_tokens, seqs) -> ContextCache:
    batch, length = seqs.tokens.shape
    shape = (batch, length, self.config.num_heads, self.model_config.head_dim)
    return ContextCache(keys=jnp.zeros(shape, jnp.float32), values=jnp.zeros(shape, jnp.float32),
                        filled=jnp.zeros((batch, length), bool),
                        stats=super().init(prompt_tokens, seqs))

  def propose(self, params: DrafterParams, state: ContextCache, context: StepContext,
              levels: int) -> Proposal:
    layer = Layer(self.config, self.model_config, params.weights)
    n = context.seqs.num_generated[:, None]  # [B, 1]: the root state's position
    visible = (state.filled & (jnp.arange(state.filled.shape[1])[None, :] < n))[:, None, :]
    h_n = self.config.first_state(self.model_config, params.weights, context.features)
    root_input = layer.entry(h_n[:, None], context.vocab.embed(context.root)[:, None])
    root_key, root_value = layer.keys_values(root_input, n)
    chain = [root_key[:, :, None], root_value[:, :, None]]  # [B, E, depth, H, Dh] each

    def first():
      return layer.attend(root_input, n, state.keys, state.values, visible, *chain)

    def advance(depth, slots, tokens, z):
      positions = jnp.broadcast_to(n + depth - 1, tokens.shape)
      inputs = layer.entry(take_slots(z, slots), context.vocab.embed(tokens))
      k, v = layer.keys_values(inputs, positions)
      chain[0] = jnp.concatenate([take_slots(chain[0], slots), k[:, :, None]], axis=2)
      chain[1] = jnp.concatenate([take_slots(chain[1], slots), v[:, :, None]], axis=2)
      return layer.attend(inputs, positions, state.keys, state.values, visible, *chain)

    laws, expanded_index = self._laws(params, context, levels, first, advance)
    candidates, guesses = self.candidates(laws, expanded_index, context)
    return Proposal(candidates=candidates,
                    record=ContextRecord(guesses, root_key[:, 0], root_value[:, 0]))

  def observe(self, params: DrafterParams, state: ContextCache, context: StepContext,
              proposal: Proposal, feedback: Feedback) -> ContextCache:
    """Writes entries n .. n + accepted of running rows (see the module docstring)."""
    layer = Layer(self.config, self.model_config, params.weights)
    record, depth = proposal.record, feedback.drawn.shape[1]
    n = context.seqs.num_generated[:, None]
    # Entry n + i (i = 1..H) from the path's node at depth i - 1 and the token at depth i.
    positions = n + jnp.arange(1, depth + 1)[None, :]
    hidden = self.config.first_state(self.model_config, params.weights,
                                     feedback.path_features[:, :depth])
    inputs = layer.entry(hidden, context.vocab.embed(feedback.drawn))
    k, v = layer.keys_values(inputs, positions)
    keys = jnp.concatenate([record.root_key[:, None], k], axis=1)  # [B, H + 1, H, Dh]
    values = jnp.concatenate([record.root_value[:, None], v], axis=1)
    slots = jnp.concatenate([n, positions], axis=1)  # [B, H + 1]
    written = ((jnp.arange(depth + 1)[None, :] <= feedback.accepted[:, None])
               & ~context.seqs.done[:, None])
    length = state.filled.shape[1]
    slots = jnp.where(written, slots, length)  # past the end: dropped
    rows = jnp.arange(slots.shape[0])[:, None]
    stats = super().observe(params, state.stats, context, proposal.replace(
        record=record.guesses), feedback)
    return ContextCache(keys=state.keys.at[rows, slots].set(keys, mode='drop'),
                        values=state.values.at[rows, slots].set(values, mode='drop'),
                        filled=state.filled.at[rows, slots].set(True, mode='drop'),
                        stats=stats)

  def row_stats(self, state: ContextCache) -> DepthStats:
    return state.stats
