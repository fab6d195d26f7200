"""The speculative engine: heads propose, a sparse tree is verified in one policy forward.

One step per running row (METHOD.md section 2): draw the root from the policy's
distribution at the last verified position; heads on that position's hidden state propose
candidates; a concurrency-aware tree of N_t nodes (tree.py) is run through the policy with
tree attention (ancestor mask, positions = prefix length + depth); sample-and-match
(verify.py) accepts a path; the path's keys/values are committed to the cache at each row's
own length, and its last node seeds the next step. Exactness does not depend on the heads:
bad heads only lower tokens per forward.
"""
import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from specroll_jax import sampling
from specroll_jax.attention import attention_implementation
from specroll_jax.config import ModelConfig
from specroll_jax.heads import HeadsConfig, apply_heads
from specroll_jax.kv_cache import KVCache, commit
from specroll_jax.mesh import constrain_rows
from specroll_jax.model import Transformer
from specroll_jax.rollout import prefill
from specroll_jax.sequences import Sequences
from specroll_jax.tree import TreeConfig, build_tree, edge_scores
from specroll_jax.verify import walk


@struct.dataclass
class SpecParams:
  """What the engine reads but never changes. `oracle_tokens` [R, max_new] (the vanilla
  rollout's tokens by response id) turns the proposer into the oracle: each head's rank-0
  candidate becomes the true future token, the ceiling of this tree design."""
  policy: dict
  heads: dict
  oracle_tokens: jax.Array | None = None


@struct.dataclass
class AcceptanceStats:
  """Per-row verifier feedback: where the walk drew, and which head rank it matched."""
  reached: jax.Array   # float32 [B, H] draws made at each depth
  hits: jax.Array      # float32 [B, H, K] draws equal to head d's rank-r token
  accepted: jax.Array  # float32 [B, H] accepted nodes at each depth
  nodes: jax.Array     # float32 [B] tree nodes verified (budget summed over steps)


@struct.dataclass
class SpecState:
  cache: KVCache
  next_logits: jax.Array   # float32 [B, V] policy logits for each row's next token
  last_hidden: jax.Array   # [B, D] policy hidden state at each row's last verified position
  seqs: Sequences
  stats: AcceptanceStats


@dataclasses.dataclass(frozen=True)
class SpecEngine:
  model_config: ModelConfig
  heads_config: HeadsConfig
  tree_config: TreeConfig
  sampler: sampling.SamplerConfig
  eos_ids: tuple
  mesh: Mesh | None = None
  prior_accept: tuple | None = None  # [H][K] initial acceptance rates; None: head probs only
  tree_attention: str = 'xla'        # attention for the tree forward (attention.py)

  def __post_init__(self):
    if self.tree_config.depth > self.heads_config.num_heads:
      raise ValueError(f'tree depth {self.tree_config.depth} (len(branching)) exceeds the '
                       f'{self.heads_config.num_heads} trained heads')

  @property
  def model(self) -> Transformer:
    return Transformer(self.model_config)

  def tree_width(self, batch: int) -> int:
    """Static node slots for a batch bucket: the budget of a full bucket, C_hw(B) // B.

    Sizing for a full bucket means no slot is computed and left empty when the segment
    starts; as rows finish inside the segment the budget stays capped at this width until
    the driver compacts the batch, and the next bucket's trees are twice as wide.
    """
    return self.tree_config.node_bucket(self.tree_config.capacity(batch), batch)

  def _prior(self):
    """[depth, K] prior acceptance rates; ranks the warm start did not measure get 0."""
    depth, k = self.tree_config.depth, self.tree_config.top_k
    prior = np.zeros((depth, k), np.float32)
    if self.prior_accept is not None:
      measured = np.asarray(self.prior_accept, np.float32)[:depth, :k]
      prior[:measured.shape[0], :measured.shape[1]] = measured
    return jnp.asarray(prior)

  @partial(jax.jit, static_argnums=(0, 4))
  def start(self, params: SpecParams, prompt_tokens, seqs: Sequences, cache_length: int):
    cache, hidden, logits = prefill(self.model, params.policy, prompt_tokens,
                                    seqs.prompt_lengths, cache_length)
    batch, depth, k = prompt_tokens.shape[0], self.tree_config.depth, self.tree_config.top_k
    stats = AcceptanceStats(reached=jnp.zeros((batch, depth)), hits=jnp.zeros((batch, depth, k)),
                            accepted=jnp.zeros((batch, depth)), nodes=jnp.zeros((batch,)))
    state = SpecState(cache=cache, next_logits=logits, last_hidden=hidden, seqs=seqs, stats=stats)
    return constrain_rows(self.mesh, state)

  @partial(jax.jit, static_argnums=0)
  def run(self, params: SpecParams, state: SpecState, seed_key, stop_at_active) -> SpecState:
    def keep_going(s):
      running = jnp.sum(~s.seqs.done)
      return (running > 0) & (running > stop_at_active)

    return jax.lax.while_loop(keep_going, lambda s: self.step(params, s, seed_key), state)

  def propose(self, params: SpecParams, last_hidden, seqs: Sequences, depth: int):
    """Top-K tokens and probabilities of the first `depth` heads (under the sampling
    transform), zero-padded to the tree depth: a tree of N slots never reaches below N - 1."""
    tc = self.tree_config
    z = apply_heads(self.heads_config, self.model_config, params.heads, last_hidden)
    z = z[:, :depth]
    logits = self.model.apply({'params': params.policy}, z, method=Transformer.project)
    if not self.sampler.greedy:
      logits = sampling.transform_logits(logits, self.sampler)
    probs, tokens = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), tc.top_k)
    tokens = tokens.astype(jnp.int32)
    if params.oracle_tokens is not None:
      # Head d's node sits d tokens after the root, whose index is num_generated.
      future = seqs.num_generated[:, None] + jnp.arange(1, depth + 1)
      true = params.oracle_tokens.at[seqs.response_ids[:, None], future].get(
          mode='fill', fill_value=0)
      tokens = tokens.at[:, :, 0].set(true)
      probs = probs.at[:, :, 0].set(1.0)
    pad = ((0, 0), (0, tc.depth - depth), (0, 0))
    return jnp.pad(tokens, pad), jnp.pad(probs, pad)

  def step(self, params: SpecParams, state: SpecState, seed_key) -> SpecState:
    seqs, stats, tc = state.seqs, state.stats, self.tree_config
    batch = seqs.done.shape[0]
    width = self.tree_width(batch)
    positions = seqs.next_positions
    root = sampling.draw(state.next_logits,
                         sampling.token_keys(seed_key, seqs.response_ids, positions), self.sampler)
    root_logprob = sampling.token_logprob(state.next_logits, root, self.sampler)

    depth = min(tc.depth, width - 1)
    head_tokens, head_probs = self.propose(params, state.last_hidden, seqs, depth)
    prior = self._prior()
    rate = ((stats.hits + tc.prior_strength * prior)
            / (stats.reached[..., None] + tc.prior_strength))
    budget = tc.budget(tc.capacity(batch), jnp.sum(~seqs.done), width)
    tree = build_tree(root, head_tokens, edge_scores(head_probs, rate, tc),
                      jnp.full((batch,), budget, jnp.int32), width, tc)

    verifier = Transformer(self.model_config, attention_implementation(self.tree_attention))
    hidden, block = verifier.apply({'params': params.policy}, tree.tokens,
                                     positions[:, None] + tree.depths,
                                     tree.ancestor_mask(tc.depth), state.cache)
    project = lambda h: self.model.apply({'params': params.policy}, h,
                                         method=Transformer.project)
    result = walk(tree, hidden, project, seed_key, seqs.response_ids, positions, self.sampler,
                  tc.depth, self.model_config.vocab_size)

    running = ~seqs.done
    logprobs = jnp.concatenate([root_logprob[:, None], result.logprobs], axis=1)
    seqs, kept = seqs.append(result.tokens, logprobs, result.accepted + 1, self.eos_ids)
    cache = commit(state.cache, block, result.path, kept)
    last = jnp.take_along_axis(hidden, result.path[jnp.arange(batch), result.accepted][:, None, None],
                               axis=1)[:, 0]

    live = running[:, None].astype(jnp.float32)
    reached = result.reached & running[:, None]
    hits = reached[..., None] & (head_tokens == result.drawn[..., None])
    depth_index = jnp.arange(1, tc.depth + 1)[None, :]
    stats = AcceptanceStats(
        reached=stats.reached + reached,
        hits=stats.hits + hits,
        accepted=stats.accepted + live * (depth_index <= result.accepted[:, None]),
        nodes=stats.nodes + live[:, 0] * budget)
    new_state = SpecState(cache=cache, next_logits=result.last_logits, last_hidden=last,
                          seqs=seqs, stats=stats)
    return constrain_rows(self.mesh, new_state)

  @staticmethod
  def row_stats(state: SpecState) -> dict:
    s = state.stats
    return {'accepted_by_depth': s.accepted, 'reached_by_depth': s.reached,
            'hits_by_rank': s.hits, 'tree_nodes': s.nodes}
