"""Prompt sources for GRPO: the embedded synthetic task or a dataset from the data directory
(`paths.data_dir`)."""
import dataclasses

from specroll_jax.tasks import data, synthetic_math


@dataclasses.dataclass(frozen=True)
class Task:
  prompt: str   # text given to the policy
  answer: str   # gold answer for rewards.score
  kind: str     # rewards.score kind: gsm8k, math or dapo


def load_tasks(source: str, *, count: int, seed: int, data_dir=None, split=None,
               chat: bool = False) -> list[Task]:
  """'synthetic:<split>' (synthetic_math) or a data.load_dataset name (e.g. 'gsm8k').

  chat: prompts are user turns for a chat template (Policy.prompt_ids(..., chat_template=True)).
  """
  if source.startswith('synthetic:'):
    problems = synthetic_math.make_problems(source.split(':', 1)[1], count, seed)
    # The problems are in GSM8K's answer format, so a chat model is asked for it the same way.
    render = ((lambda q: data.GSM8K_CHAT_TEMPLATE.replace('{input}', q)) if chat
              else synthetic_math.prompt)
    return [Task(render(p.question), p.answer, 'gsm8k') for p in problems]
  loaded = data.load_dataset(source, data_dir=data_dir, split=split, chat=chat)
  return [Task(e.prompt, e.answer, e.kind) for e in loaded.examples]
