"""What a rollout returns per response, and the summary every engine reports."""
import dataclasses
from typing import Any

FINISH_EOS = 'eos'
FINISH_LENGTH = 'length'


@dataclasses.dataclass
class Response:
  prompt_index: int
  sample_index: int
  token_ids: list
  logprobs: list
  finish_reason: str
  steps: int        # policy forwards this response took part in
  stats: Any = None  # the engine's typed per-row statistics (numpy leaves); None for vanilla


def summarize(responses) -> dict:
  """tau: tokens per policy forward a response took part in."""
  tokens = sum(len(r.token_ids) for r in responses)
  steps = sum(r.steps for r in responses)
  return {'responses': len(responses), 'tokens': tokens, 'row_forwards': steps,
          'tau': tokens / max(steps, 1)}
