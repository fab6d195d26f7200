"""Prompt/answer loaders for the math RL datasets in the shared data directory.

The JSONL files are read in place (never copied into the repo) from the data directory
that `paths.data_dir` chooses: an explicit `data_dir`, else $SPECROLL_DATA_DIR, else
`../shared/data` next to the repository. Each row becomes an `Example`
whose `answer` is the gold answer in the form `rewards.score` expects for its
`kind`. Malformed rows are skipped and counted rather than fatal: one bad line in a
17K-row file should not stop a run, but the count is reported so it is not silent.

Default prompt templates (override with `template=`; `{input}` marks the question):
  gsm8k           GSM8K_TEMPLATE: asks for the final number after '####'.
  math, eval sets SIMPLERL_TEMPLATE: the prompt commonly used with SimpleRL-Abel.
                  It does not ask for the \\boxed{} answer the reward reads (models
                  tuned on MATH-style solutions box anyway); BOXED_TEMPLATE does.
  dapo            BOXED_TEMPLATE: asks for the final answer in \\boxed{}.
With chat=True (instruct models) the prompt is the user turn a chat template wraps:
  gsm8k           GSM8K_CHAT_TEMPLATE: the question, then end with '#### <number>'.
  the others      BOXED_CHAT_TEMPLATE: the question, then the answer in \\boxed{}.
"""
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Callable

from specroll_jax.tasks import rewards
from specroll_jax.tasks import paths

SIMPLERL_TEMPLATE = "Question:\n{input}\nAnswer:\nLet's think step by step.\n"
GSM8K_TEMPLATE = ("Question:\n{input}\nSolve the problem step by step, then write the "
                  "final numerical answer after '####'.\nAnswer:\n")
BOXED_TEMPLATE = ('Solve the following math problem step by step. Put your final answer '
                  'within \\boxed{}.\n\n{input}\n')
GSM8K_CHAT_TEMPLATE = ('{input}\n\nSolve the problem step by step. End your answer with '
                       "'#### <number>', where <number> is the final numerical answer.")
BOXED_CHAT_TEMPLATE = ('{input}\n\nSolve the problem step by step. Put your final answer '
                       'within \\boxed{}.')

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  answer: str  # Gold answer for rewards.score(completion, answer, kind).
  kind: str  # Reward kind: 'gsm8k', 'math' or 'dapo'.
  source: str  # Dataset name, e.g. 'math500'.
  index: int  # 0-based line in the source file: stable when earlier rows are skipped.


@dataclasses.dataclass(frozen=True)
class LoadedDataset:
  examples: list[Example]
  skipped: int  # Malformed rows left out.


def _text(value: Any) -> str | None:
  """A non-empty string field, or None. AMC23 stores answers as floats (27.0)."""
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if isinstance(value, str) and value.strip():
    return value.strip()
  return None


def _answer_field(row: dict) -> str | None:
  return _text(row.get('answer'))


def _gsm8k_gold(row: dict) -> str | None:
  solution = _answer_field(row)
  if solution is None or '####' not in solution:
    return None
  return rewards.extract_answer(solution, 'gsm8k')


def _boxed_in_solution(row: dict) -> str | None:
  solution = _text(row.get('solution'))
  return rewards.last_boxed(solution) if solution else None


@dataclasses.dataclass(frozen=True)
class _Spec:
  splits: dict[str, str]  # split -> file under data_dir; the first is the default.
  kind: str
  question_field: str
  gold: Callable[[dict], str | None]
  template: str
  chat_template: str = BOXED_CHAT_TEMPLATE


def _eval_spec(file: str, gold=_answer_field) -> _Spec:
  return _Spec({'test': f'eval/{file}'}, 'math', 'problem', gold, SIMPLERL_TEMPLATE)


_SPECS = {
    'gsm8k': _Spec({'train': 'gsm8k/train.jsonl', 'test': 'gsm8k/test.jsonl'}, 'gsm8k',
                   'question', _gsm8k_gold, GSM8K_TEMPLATE, GSM8K_CHAT_TEMPLATE),
    'math': _Spec({'train': 'math/level3to5.jsonl'}, 'math', 'problem', _answer_field,
                  SIMPLERL_TEMPLATE),
    'dapo': _Spec({'train': 'dapo/dapo_math_17k.jsonl'}, 'dapo', 'problem', _answer_field,
                  BOXED_TEMPLATE),
    'math500': _eval_spec('math500.test.jsonl'),
    'aime24': _eval_spec('aime24.test.jsonl'),
    'amc23': _eval_spec('amc23.test.jsonl'),
    # Minerva has no answer field; its solutions box the final answer.
    'minerva_math': _eval_spec('minerva_math.test.jsonl', gold=_boxed_in_solution),
}
DATASETS = tuple(_SPECS)
# Every file a data directory may hold, relative to it.
DATA_LAYOUT = tuple(file for spec in _SPECS.values() for file in spec.splits.values())


def load_dataset(name: str, data_dir: str | Path | None = None, split: str | None = None,
                 template: str | None = None, chat: bool = False) -> LoadedDataset:
  """Loads one split of a dataset as prompts with gold answers.

  Args:
    name: one of DATASETS.
    data_dir: the data directory; None chooses it as `paths.data_dir` does.
    split: gsm8k has 'train' (default) and 'test'; math and dapo only 'train'; the
      eval sets (math500, aime24, amc23, minerva_math) only 'test'.
    template: prompt template with an `{input}` field; defaults to the dataset's.
    chat: the default template is the dataset's user turn for a chat template.

  Raises:
    ValueError: unknown name or split, or a file with no valid row.
    FileNotFoundError: the data directory or the split's file is missing.
  """
  if name not in _SPECS:
    raise ValueError(f'unknown dataset {name!r}; expected one of {DATASETS}')
  spec = _SPECS[name]
  split = split or next(iter(spec.splits))
  if split not in spec.splits:
    raise ValueError(f'dataset {name!r} has no split {split!r}; expected one of '
                     f'{tuple(spec.splits)}')
  path = paths.data_dir(data_dir, DATA_LAYOUT) / spec.splits[split]
  if not path.is_file():
    raise FileNotFoundError(f'{name} {split} file not found: {path}')

  template = template or (spec.chat_template if chat else spec.template)
  if '{input}' not in template:
    raise ValueError(f'prompt template has no {{input}} field: {template!r}')
  examples, bad_lines = [], []
  with path.open(encoding='utf-8') as lines:
    for line_index, line in enumerate(lines):
      if not line.strip():
        continue
      example = _parse_row(line, spec, template, name, line_index)
      if example is None:
        bad_lines.append(line_index + 1)
      else:
        examples.append(example)
  if bad_lines:
    _log.warning('%s: skipped %d malformed rows (first at line %d)', path, len(bad_lines),
                 bad_lines[0])
  if not examples:
    raise ValueError(f'no valid rows in {path}')
  return LoadedDataset(examples, len(bad_lines))


def _parse_row(line: str, spec: _Spec, template: str, name: str,
               index: int) -> Example | None:
  try:
    row = json.loads(line)
  except json.JSONDecodeError:
    return None
  if not isinstance(row, dict):
    return None
  question = _text(row.get(spec.question_field))
  gold = spec.gold(row)
  if question is None or gold is None:
    return None
  # replace, not str.format: templates may hold LaTeX braces such as \boxed{}.
  return Example(template.replace('{input}', question), gold, spec.kind, name, index)
