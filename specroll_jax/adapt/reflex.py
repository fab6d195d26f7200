"""Reflex: gradient-free, per-response correction of the heads' hidden states (METHOD.md 4).

Every proposal q_{t,k} (head k's distribution for the token at position P + k, P = the
root's position) is kept as a sketch: its top-K ids and log-probs (K = the tree's widest
branching; the candidate set C is head k's top branching[k] of them, the ranks the tree
may offer from that head) and the memory m_k as it was when the proposal was made. It matures when the policy's distribution p for that position is known,
which is when a verification walk draws there (this step for the depths it reached, a
later step otherwise). A matured pair gives a feedback vector in hidden space through the
shared projection W:

    r_dist = sum_{v in C} (p(v) - q(v)) W[v]               (mass misplaced inside C)
    r_cov  = sum_{v in top-M(p), v not in C} p(v) (W[v] - mean_{u in C} W[u])   (mass missed)

with top-M(p) the policy's M most likely tokens there (the verifier walk keeps them).

W^T (p - q) is minus the cross-entropy gradient at the head's hidden output, so moving z
along r moves q toward p without a backward pass. The memory is an exponential average of
unit feedback directions; its reliability is the running cosine between each new feedback
and the memory that was in place when the proposal was made (did past errors predict this
one?). The correction z' = z + eta * g * clip_norm(m_k / (1 - lambda^n), c) * ||h_t|| (n =
feedbacks so far; its norm is at most eta * c * ||h_t||) is gated by
g = clip((rho_k - tau_rel) / (1 - tau_rel), 0, 1), so it stays shut on noise.

While every gate of a row is shut its correction is zero, so feedback buys only the
evidence that could open a gate. Such a row listens on a schedule (`shut_listen_interval`):
it sketches one of every I proposals and hears feedback for the H proposals from there (a
sketch matures within H steps: its target lies at most H positions ahead), and a step in
which no running row listens skips the feedback computation altogether. I = 1 listens on
every step.

Pending sketches live in a ring of H slots per head indexed by target position mod H:
pending targets of a row always lie in [P + 1, P + H], so slots never collide. All state
is per row, created zeroed with the row (one response per row), and carried through the
jitted rollout loop; nothing here touches what the verifier emits.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import struct


@dataclasses.dataclass(frozen=True)
class ReflexConfig:
  half_life: float = 48.0        # matured feedbacks (about tokens) for the memory to halve
  reliability_decay: float = 0.95  # beta of the reliability average (~39 feedbacks)
  gate_threshold: float = 0.1    # tau_rel: reliability below this keeps the gate shut
  step_size: float = 1.0         # eta: correction per unit of gated memory, in units of ||h_t||
  max_correction: float = 0.5    # c: bound on the memory's norm (correction <= eta c ||h_t||)
  dist_weight: float = 1.0       # a: weight of the distribution error
  coverage_weight: float = 1.0   # b: weight of the coverage error
  # I: a row whose gates are all shut sketches every I-th proposal (1: every proposal). The
  # feedback computation (gathers of embedding rows for every sketch and target) was +10%
  # of W1's generation time with gates open 0.5-4% of the time.
  shut_listen_interval: int = 16

  def __post_init__(self):
    if self.half_life <= 0:
      raise ValueError(f'half_life must be > 0, got {self.half_life}')
    if not 0.0 <= self.reliability_decay < 1.0:
      raise ValueError(f'reliability_decay must be in [0, 1), got {self.reliability_decay}')
    if not -1.0 <= self.gate_threshold < 1.0:
      raise ValueError(f'gate_threshold must be in [-1, 1), got {self.gate_threshold}')
    if self.step_size < 0 or self.max_correction < 0:
      raise ValueError('step_size and max_correction must be >= 0')
    if self.shut_listen_interval < 1:
      raise ValueError(f'shut_listen_interval must be >= 1, got {self.shut_listen_interval}')

  @property
  def memory_decay(self) -> float:
    return 0.5 ** (1.0 / self.half_life)


@struct.dataclass
class ReflexTrace:
  """What Reflex did for each row (instrumentation, Response.stats); never read back."""
  alignment: jax.Array       # float32 [B, H] sum of delayed alignments cos(m_then, r)
  dist_error: jax.Array      # float32 [B, H] sum of sum_{v in C} |p(v) - q(v)|
  coverage_error: jax.Array  # float32 [B, H] sum of p mass outside C
  gate: jax.Array            # float32 [B, S, H] gate per engine step (S = max new tokens)
  reliability: jax.Array     # float32 [B, S, H] rho_k per engine step
  correction: jax.Array      # float32 [B, S, H] ||correction|| / ||h_t|| per engine step


@struct.dataclass
class ReflexState:
  memory: jax.Array            # float32 [B, H, D] m_k, average of unit feedbacks (norm <= 1)
  reliability: jax.Array       # float32 [B, H] rho_k
  pending_ids: jax.Array       # int32 [B, H(slot), H, K] sketch ids, best first
  pending_logq: jax.Array      # float32 [B, H(slot), H, K] their log-probs under the sampler
  pending_memory: jax.Array    # float32 [B, H(slot), H, D] m_k when the proposal was made
  pending_position: jax.Array  # int32 [B, H(slot), H] target position; -1 = empty slot
  matured: jax.Array           # float32 [B, H] feedbacks received
  proposals: jax.Array         # int32 [B] proposals made (the listening schedule's clock)
  trace: ReflexTrace

  @classmethod
  def init(cls, batch: int, heads: int, dim: int, candidates: int, max_steps: int):
    m = candidates
    zeros = lambda *shape: jnp.zeros(shape, jnp.float32)
    return cls(
        memory=zeros(batch, heads, dim), reliability=zeros(batch, heads),
        pending_ids=jnp.zeros((batch, heads, heads, m), jnp.int32),
        pending_logq=zeros(batch, heads, heads, m),
        pending_memory=zeros(batch, heads, heads, dim),
        pending_position=jnp.full((batch, heads, heads), -1, jnp.int32),
        matured=zeros(batch, heads), proposals=jnp.zeros((batch,), jnp.int32),
        trace=ReflexTrace(alignment=zeros(batch, heads), dist_error=zeros(batch, heads),
                          coverage_error=zeros(batch, heads),
                          gate=zeros(batch, max_steps, heads),
                          reliability=zeros(batch, max_steps, heads),
                          correction=zeros(batch, max_steps, heads)))


def gate(config: ReflexConfig, reliability):
  return jnp.clip((reliability - config.gate_threshold) / (1.0 - config.gate_threshold), 0.0, 1.0)


def listening(config: ReflexConfig, state: ReflexState, g):
  """(sketches, hears) bool [B] for the proposal being made now under gate g [B, H]: a row
  with an open gate does both on every proposal; a shut row sketches one proposal in every
  `shut_listen_interval` and hears feedback on that one and the H - 1 after it."""
  is_open = jnp.any(g > 0, axis=-1)
  phase = state.proposals % config.shut_listen_interval
  return is_open | (phase == 0), is_open | (phase < g.shape[-1])


def _unit(x):
  """x / ||x|| along the last axis; 0 where x is (numerically) 0."""
  norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
  return jnp.where(norm > 1e-12, x / jnp.maximum(norm, 1e-30), 0.0)


def _clip_norm(x, bound):
  norm = jnp.linalg.norm(x, axis=-1, keepdims=True)
  return x * jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-30))


def correction(config: ReflexConfig, state: ReflexState, hidden):
  """Bounded corrections [B, H, D] for the heads' hidden outputs at last hidden `hidden`
  [B, D], with the gate [B, H] and relative norm ||delta|| / ||h|| [B, H] (instrumentation).
  A non-finite memory or hidden state gives no correction."""
  g = gate(config, state.reliability)
  h_norm = jnp.linalg.norm(hidden.astype(jnp.float32), axis=-1)[:, None, None]
  # Bias-corrected like Adam's moments: after n consistent feedbacks the raw average has
  # norm 1 - lambda^n, which would mute the memory for the first ~half-life tokens.
  unbiased = state.memory / jnp.maximum(1.0 - config.memory_decay ** state.matured, 1e-6)[..., None]
  relative = config.step_size * g[..., None] * _clip_norm(unbiased, config.max_correction)
  delta = relative * h_norm
  finite = jnp.all(jnp.isfinite(delta), axis=-1, keepdims=True)
  delta = jnp.where(finite, delta, 0.0)
  return delta, g, jnp.where(finite[..., 0], jnp.linalg.norm(relative, axis=-1), 0.0)


def record_trace(state: ReflexState, step_index, running, g, relative_norm) -> ReflexState:
  """Writes this step's gate, reliability and correction size at each running row's step."""
  rows = jnp.arange(step_index.shape[0])
  trace = state.trace
  index = jnp.where(running, step_index, trace.gate.shape[1])  # out of range: dropped
  put = lambda buffer, value: buffer.at[rows, index].set(value, mode='drop')
  return state.replace(trace=trace.replace(
      gate=put(trace.gate, g), reliability=put(trace.reliability, state.reliability),
      correction=put(trace.correction, relative_norm)))


def record_proposals(state: ReflexState, ids, logq, root_positions, proposed) -> ReflexState:
  """Stores each head's proposal sketch (ids, logq [B, H, K]) for target position root + k.

  proposed: bool [B, H], which heads proposed this step (running rows, evaluated heads).
  """
  batch, heads = proposed.shape
  rows = jnp.arange(batch)[:, None]
  head = jnp.arange(heads)[None, :]
  target = root_positions[:, None] + head + 1
  slot = jnp.where(proposed, target % heads, heads)  # out of range: dropped
  put = lambda buffer, value: buffer.at[rows, slot, head].set(value, mode='drop')
  memory = jnp.broadcast_to(state.memory, state.pending_memory[:, 0].shape)
  return state.replace(pending_ids=put(state.pending_ids, ids),
                       pending_logq=put(state.pending_logq, logq),
                       pending_memory=put(state.pending_memory, memory),
                       pending_position=put(state.pending_position, target))


def feedback(ids_q, logq, in_candidates, ids_p, probs_p, rows_q, rows_p, config: ReflexConfig):
  """The feedback vector of one matured proposal, with its error masses.

  ids_q, logq, in_candidates: [..., K] the proposal sketch and its candidate set C;
  ids_p, probs_p: [..., M] the policy's top-M; rows_q: [..., K, D] = W[ids_q];
  rows_p: [..., M, D] = W[ids_p] (leading dims may be 1 where the policy side is shared).
  Returns (r [..., D], sum_{v in C} |p(v) - q(v)|, p mass outside C).
  """
  same = ids_q[..., :, None] == ids_p[..., None, :]                       # [..., K, M]
  p_at_q = jnp.sum(jnp.where(same, probs_p[..., None, :], 0.0), axis=-1)  # p of q's ids
  c = in_candidates.astype(jnp.float32)
  e_dist = c * (p_at_q - jnp.exp(logq))
  covered = jnp.any(same & in_candidates[..., :, None], axis=-2)
  e_cov = jnp.where(covered, 0.0, probs_p)
  mean_c = (jnp.einsum('...k,...kd->...d', c, rows_q)
            / jnp.maximum(jnp.sum(c, axis=-1, keepdims=True), 1.0))
  r_dist = jnp.einsum('...k,...kd->...d', e_dist, rows_q)
  # sum_v e_cov(v) (W[v] - mean_C) without materialising W[v] - mean_C per head.
  r_cov = (jnp.einsum('...m,...md->...d', e_cov, rows_p)
           - jnp.sum(e_cov, axis=-1, keepdims=True) * mean_c)
  r = config.dist_weight * r_dist + config.coverage_weight * r_cov
  return r, jnp.sum(jnp.abs(e_dist), axis=-1), jnp.sum(e_cov, axis=-1)


def mature(config: ReflexConfig, state: ReflexState, target_ids, target_probs, reached,
           root_positions, candidates_per_head, vocab_rows) -> ReflexState:
  """Matures every pending proposal whose target position the walk drew at this step.

  target_ids, target_probs: [B, H, M] top-M of the policy's distribution at walk depth j,
  the law of the token at root + j; reached: bool [B, H] (depth j was drawn, row running);
  candidates_per_head: static tuple, |C| of each head (its tree branching);
  vocab_rows: ids [...] -> W[ids] [..., D].
  """
  batch, heads, _ = target_ids.shape
  rows = jnp.arange(batch)
  in_candidates = (jnp.arange(state.pending_ids.shape[-1])[None, :]
                   < jnp.asarray(candidates_per_head)[:, None])          # [H, K]
  decay, beta = config.memory_decay, config.reliability_decay
  for j in range(heads):  # feedbacks mature in position order
    position = root_positions + j + 1
    slot = position % heads
    ids_q = state.pending_ids[rows, slot]                                 # [B, H, K]
    pending = state.pending_position[rows, slot] == position[:, None]     # [B, H]
    live = pending & reached[:, j:j + 1]
    # The policy side is the same for every head: [B, 1, M] broadcasts against [B, H, K].
    r, dist_err, cov_err = feedback(ids_q, state.pending_logq[rows, slot], in_candidates,
                                    target_ids[:, j, None], target_probs[:, j, None],
                                    vocab_rows(ids_q), vocab_rows(target_ids[:, j])[:, None],
                                    config)
    unit = _unit(r)
    alignment = jnp.sum(_unit(state.pending_memory[rows, slot]) * unit, axis=-1)
    memory = jnp.where(live[..., None], decay * state.memory + (1 - decay) * unit, state.memory)
    reliability = jnp.where(live, beta * state.reliability + (1 - beta) * alignment,
                            state.reliability)
    finite = jnp.all(jnp.isfinite(memory), axis=-1) & jnp.isfinite(reliability)
    live_f = live.astype(jnp.float32)
    trace = state.trace
    state = state.replace(
        memory=jnp.where(finite[..., None], memory, 0.0),
        reliability=jnp.where(finite, reliability, 0.0),
        pending_position=state.pending_position.at[rows, slot].set(
            jnp.where(live, -1, state.pending_position[rows, slot])),
        matured=state.matured + live_f,
        trace=trace.replace(
            alignment=trace.alignment + live_f * jnp.nan_to_num(alignment),
            dist_error=trace.dist_error + live_f * jnp.nan_to_num(dist_err),
            coverage_error=trace.coverage_error + live_f * jnp.nan_to_num(cov_err)))
  return state
