"""Reflex-corrected horizon heads: the head proposer with Reflex's fast path (reflex.py).

Before the heads' hidden outputs reach the shared projection, each row's gated memory
corrects them; after the walk, the step's proposals are kept as sketches and the ones
whose target positions the walk drew mature into the memory. The candidates, their scores
and the heads' statistics are the head proposer's, computed from the corrected proposals.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from specroll_jax.adapt import reflex
from specroll_jax.adapt.reflex import ReflexConfig, ReflexState, ReflexTrace
from specroll_jax.speculative.head_proposer import DepthStats, HeadGuesses, HeadProposer
from specroll_jax.speculative.proposer import Feedback, Proposal, Proposer, StepContext


@struct.dataclass
class ReflexProposerState:
  heads: DepthStats
  reflex: ReflexState


@struct.dataclass
class ReflexRecord:
  guesses: HeadGuesses   # the corrected heads' top-K: offered to the tree, then sketched
  gate: jax.Array        # float32 [B, H] the gate that was applied
  correction: jax.Array  # float32 [B, H] ||correction|| / ||h_t||


@struct.dataclass
class ReflexRowStats:
  heads: DepthStats
  reflex: ReflexTrace
  matured: jax.Array  # float32 [B, H] feedbacks each head received


@dataclasses.dataclass(frozen=True)
class ReflexProposer(Proposer):
  heads: HeadProposer
  config: ReflexConfig

  @property
  def depth(self) -> int:
    return self.heads.depth

  @property
  def num_candidates(self) -> int:
    return self.heads.num_candidates

  @property
  def feedback_top_m(self) -> int:
    return self.heads.feedback_top_m

  @property
  def feature_layers(self) -> tuple:
    return self.heads.feature_layers

  def init(self, prompt_tokens, seqs) -> ReflexProposerState:
    h = self.heads
    batch, max_steps = seqs.tokens.shape
    return ReflexProposerState(
        heads=h.init(prompt_tokens, seqs),
        reflex=ReflexState.init(batch, self.depth, h.model_config.hidden_size, h.draft.top_k,
                                max_steps))

  def propose(self, params, state: ReflexProposerState, context: StepContext,
              levels: int) -> Proposal:
    z = self.heads.head_states(params, context.hidden, levels)
    delta, gate, correction = reflex.correction(self.config, state.reflex, context.hidden)
    z = (z.astype(jnp.float32) + delta[:, :levels]).astype(z.dtype)
    guesses = self.heads.guesses(z, context)
    return Proposal(candidates=self.heads.candidates(guesses, state.heads),
                    record=ReflexRecord(guesses=guesses, gate=gate, correction=correction))

  def observe(self, params, state: ReflexProposerState, context: StepContext,
              proposal: Proposal, feedback: Feedback) -> ReflexProposerState:
    del params
    record, seqs, branching = proposal.record, context.seqs, self.heads.draft.branching
    positions, running = seqs.next_positions, ~seqs.done
    sketches, hears = reflex.listening(self.config, state.reflex, record.gate)

    def learn(memory):
      memory = reflex.record_proposals(memory, record.guesses.tokens,
                                       jnp.log(record.guesses.probs), positions,
                                       record.guesses.proposed & sketches[:, None])
      return reflex.mature(self.config, memory, feedback.target_ids, feedback.target_probs,
                           feedback.drew & hears[:, None], positions, branching,
                           context.vocab.rows)

    memory = reflex.record_trace(state.reflex, seqs.steps, running, record.gate,
                                 record.correction)
    # Skipping changes nothing: a row that does not hear does not sketch either, so when no
    # running row hears, learn would leave the state as it is.
    memory = jax.lax.cond(jnp.any(running & hears), learn, lambda m: m, memory)
    memory = memory.replace(proposals=memory.proposals + running.astype(jnp.int32))
    return ReflexProposerState(
        heads=state.heads.record(record.guesses, feedback, branching), reflex=memory)

  def row_stats(self, state: ReflexProposerState) -> ReflexRowStats:
    return ReflexRowStats(heads=state.heads, reflex=state.reflex.trace,
                          matured=state.reflex.matured)

  def head_stats(self, stats: ReflexRowStats) -> DepthStats:
    return stats.heads

  def summarize(self, stats: list, steps: list) -> dict:
    """Per head: mean delayed alignment and error masses per matured feedback; mean gate,
    reliability and relative correction over the engine steps of every response."""
    traces = [s.reflex for s in stats]
    total = lambda name: np.sum([getattr(t, name) for t in traces], axis=0)
    matured = np.maximum(np.sum([s.matured for s in stats], axis=0), 1)
    per_step = lambda name: np.concatenate([getattr(t, name)[:n] for t, n in zip(traces, steps)])
    out = {f'reflex_{name}': (total(name) / matured).round(4).tolist()
           for name in ('alignment', 'dist_error', 'coverage_error')}
    out.update({f'reflex_{name}': per_step(name).mean(axis=0).round(4).tolist()
                for name in ('gate', 'reliability', 'correction')})
    return out
