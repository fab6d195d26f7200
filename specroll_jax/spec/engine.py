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

from specroll_jax.adapt import reflex
from specroll_jax.rollout import sampling
from specroll_jax.model.attention import attention_implementation
from specroll_jax.model.config import ModelConfig
from specroll_jax.spec.heads import HeadsConfig, apply_heads
from specroll_jax.model.kv_cache import KVCache, commit
from specroll_jax.model.mesh import constrain_rows
from specroll_jax.adapt.reflex import ReflexConfig, ReflexState
from specroll_jax.model.transformer import Transformer
from specroll_jax.rollout.driver import prefill
from specroll_jax.rollout.sequences import Sequences
from specroll_jax.spec.tree import TreeConfig, build_tree, edge_scores
from specroll_jax.spec.verify import walk


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
  candidate_mass: jax.Array  # float32 [B, H] policy mass on head d's candidates, where reached


@struct.dataclass
class SpecState:
  cache: KVCache
  next_logits: jax.Array   # float32 [B, V] policy logits for each row's next token
  last_hidden: jax.Array   # [B, D] policy hidden state at each row's last verified position
  seqs: Sequences
  stats: AcceptanceStats
  reflex: ReflexState | None  # None when the engine runs without Reflex


@struct.dataclass
class Proposal:
  tokens: jax.Array       # int32 [B, H, K] tree candidates per head, best first
  probs: jax.Array        # float32 [B, H, K] their probabilities under the sampler
  sketch_ids: jax.Array   # int32 [B, H, K] the head's own top-K (Reflex's pending sketch)
  sketch_logq: jax.Array  # float32 [B, H, K] their log-probs
  gate: jax.Array         # float32 [B, H] Reflex gate (0 without Reflex)
  correction: jax.Array   # float32 [B, H] ||Reflex correction|| / ||h_t||


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
  reflex: ReflexConfig | None = None  # the fast path (reflex.py); None = static heads
  sketch_size: int = 32              # M: top tokens of the policy kept at each verifier draw

  def __post_init__(self):
    if self.tree_config.depth > self.heads_config.num_heads:
      raise ValueError(f'tree depth {self.tree_config.depth} (len(branching)) exceeds the '
                       f'{self.heads_config.num_heads} trained heads')

  @property
  def sketch(self) -> int:
    return min(self.sketch_size, self.model_config.vocab_size)

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
                            accepted=jnp.zeros((batch, depth)), nodes=jnp.zeros((batch,)),
                            candidate_mass=jnp.zeros((batch, depth)))
    reflex_state = None
    if self.reflex is not None:
      # A row carries one response for its whole life, so Reflex starts fresh per response.
      reflex_state = ReflexState.init(batch, depth, self.model_config.hidden_size, k,
                                      seqs.tokens.shape[1])
    state = SpecState(cache=cache, next_logits=logits, last_hidden=hidden, seqs=seqs,
                      stats=stats, reflex=reflex_state)
    return constrain_rows(self.mesh, state)

  @partial(jax.jit, static_argnums=0)
  def run(self, params: SpecParams, state: SpecState, seed_key, stop_at_active) -> SpecState:
    def keep_going(s):
      running = jnp.sum(~s.seqs.done)
      return (running > 0) & (running > stop_at_active)

    return jax.lax.while_loop(keep_going, lambda s: self.step(params, s, seed_key), state)

  def propose(self, params: SpecParams, state: SpecState, depth: int) -> Proposal:
    """The first `depth` heads' proposals (Reflex-corrected), zero-padded to the tree depth:
    a tree of N slots never reaches below N - 1, so deeper heads are not evaluated."""
    tc, batch = self.tree_config, state.seqs.done.shape[0]
    z = apply_heads(self.heads_config, self.model_config, params.heads, state.last_hidden)
    z = z[:, :depth]
    gate = correction = jnp.zeros((batch, tc.depth), jnp.float32)
    if self.reflex is not None:
      delta, gate, correction = reflex.correction(self.reflex, state.reflex, state.last_hidden)
      z = (z.astype(jnp.float32) + delta[:, :depth]).astype(z.dtype)
    logits = self.model.apply({'params': params.policy}, z, method=Transformer.project)
    probs, tokens = jax.lax.top_k(sampling.distribution(logits, self.sampler), tc.top_k)
    tokens = tokens.astype(jnp.int32)
    sketch_ids, sketch_logq = tokens, jnp.log(probs)  # the heads' own, before any oracle
    if params.oracle_tokens is not None:
      # Head d's node sits d tokens after the root, whose index is num_generated.
      seqs = state.seqs
      future = seqs.num_generated[:, None] + jnp.arange(1, depth + 1)
      true = params.oracle_tokens.at[seqs.response_ids[:, None], future].get(
          mode='fill', fill_value=0)
      tokens = tokens.at[:, :, 0].set(true)
      probs = probs.at[:, :, 0].set(1.0)
    pad = lambda x: jnp.pad(x, ((0, 0), (0, tc.depth - depth), (0, 0)))
    return Proposal(tokens=pad(tokens), probs=pad(probs), sketch_ids=pad(sketch_ids),
                    sketch_logq=pad(sketch_logq), gate=gate, correction=correction)

  def step(self, params: SpecParams, state: SpecState, seed_key) -> SpecState:
    seqs, stats, tc = state.seqs, state.stats, self.tree_config
    batch = seqs.done.shape[0]
    width = self.tree_width(batch)
    positions = seqs.next_positions
    root = sampling.draw(state.next_logits,
                         sampling.token_keys(seed_key, seqs.response_ids, positions), self.sampler)
    root_logprob = sampling.token_logprob(state.next_logits, root, self.sampler)

    depth = min(tc.depth, width - 1)
    proposal = self.propose(params, state, depth)
    head_tokens = proposal.tokens
    prior = self._prior()
    rate = ((stats.hits + tc.prior_strength * prior)
            / (stats.reached[..., None] + tc.prior_strength))
    budget = tc.budget(tc.capacity(batch), jnp.sum(~seqs.done), width)
    tree = build_tree(root, head_tokens, edge_scores(proposal.probs, rate, tc),
                      jnp.full((batch,), budget, jnp.int32), width, tc)

    verifier = Transformer(self.model_config, attention_implementation(self.tree_attention))
    hidden, block = verifier.apply({'params': params.policy}, tree.tokens,
                                     positions[:, None] + tree.depths,
                                     tree.ancestor_mask(tc.depth), state.cache)
    project = lambda h: self.model.apply({'params': params.policy}, h,
                                         method=Transformer.project)
    result = walk(tree, hidden, project, seed_key, seqs.response_ids, positions, self.sampler,
                  tc.depth, self.model_config.vocab_size, self.sketch)

    running = ~seqs.done
    logprobs = jnp.concatenate([root_logprob[:, None], result.logprobs], axis=1)
    seqs, kept = seqs.append(result.tokens, logprobs, result.accepted + 1, self.eos_ids)
    cache = commit(state.cache, block, result.path, kept)
    last = jnp.take_along_axis(hidden, result.path[jnp.arange(batch), result.accepted][:, None, None],
                               axis=1)[:, 0]

    live = running[:, None].astype(jnp.float32)
    drew = result.reached & running[:, None]
    # Head statistics count only the depths whose head proposed this step.
    proposed = running[:, None] & (jnp.arange(tc.depth) < depth)[None, :]
    reached = drew & proposed
    hits = reached[..., None] & (head_tokens == result.drawn[..., None])
    depth_index = jnp.arange(1, tc.depth + 1)[None, :]
    in_candidates = jnp.arange(tc.top_k)[None, :] < jnp.asarray(tc.branching)[:, None]
    on_candidates = jnp.any((result.target_ids[..., None] == head_tokens[:, :, None, :])
                            & in_candidates[None, :, None, :], axis=-1)
    mass = jnp.sum(jnp.where(on_candidates, result.target_probs, 0.0), axis=-1)
    stats = AcceptanceStats(
        reached=stats.reached + reached,
        hits=stats.hits + hits,
        accepted=stats.accepted + live * (depth_index <= result.accepted[:, None]),
        nodes=stats.nodes + live[:, 0] * budget,
        candidate_mass=stats.candidate_mass + jnp.where(reached, mass, 0.0))
    reflex_state = state.reflex
    if self.reflex is not None:
      vocab_rows = lambda ids: self.model.apply({'params': params.policy}, ids,
                                                method=Transformer.vocab_rows)
      reflex_state = reflex.record_trace(reflex_state, state.seqs.steps, running,
                                         proposal.gate, proposal.correction)
      reflex_state = reflex.record_proposals(reflex_state, proposal.sketch_ids,
                                             proposal.sketch_logq, positions, proposed)
      reflex_state = reflex.mature(self.reflex, reflex_state, result.target_ids,
                                   result.target_probs, drew, positions, tc.branching,
                                   vocab_rows)
    new_state = SpecState(cache=cache, next_logits=result.last_logits, last_hidden=last,
                          seqs=seqs, stats=stats, reflex=reflex_state)
    return constrain_rows(self.mesh, new_state)

  @staticmethod
  def row_stats(state: SpecState) -> dict:
    s = state.stats
    stats = {'accepted_by_depth': s.accepted, 'reached_by_depth': s.reached,
             'hits_by_rank': s.hits, 'tree_nodes': s.nodes, 'candidate_mass': s.candidate_mass}
    if state.reflex is not None:
      stats.update(reflex.row_stats(state.reflex))
    return stats
