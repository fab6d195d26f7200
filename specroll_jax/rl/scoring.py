"""Rewards of a rollout's responses under the run's reward rule (tasks.rewards.REWARD_RULES)."""
import jax
import numpy as np
from jax.experimental import multihost_utils

from specroll_jax.tasks import rewards


def scored(rule: str, tasks, responses, tokenizer) -> np.ndarray:
  """Rewards of every response (`tasks`: one per prompt, `r.prompt_index` into them), each
  process scoring its own block of the prompts (its share of the answer checks), gathered
  so every process holds them all."""
  share = len(tasks) // jax.process_count()
  mine = range(jax.process_index() * share, (jax.process_index() + 1) * share)
  scores = np.array([rewards.reward(rule, tokenizer.decode(r.token_ids, skip_special_tokens=True),
                                    tasks[r.prompt_index].answer, tasks[r.prompt_index].kind,
                                    tasks[r.prompt_index].prompt)
                     for r in responses if r.prompt_index in mine], np.float32)
  if jax.process_count() == 1:
    return scores
  return np.asarray(multihost_utils.process_allgather(scores)).reshape(-1)
