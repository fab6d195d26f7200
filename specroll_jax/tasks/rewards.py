"""Binary correctness rewards for GSM8K, MATH and DAPO completions.

`score` returns 1.0 when the completion's final answer matches the gold answer and
0.0 otherwise (no answer, wrong answer, unparseable answer). It never raises on
model text: a reward function that crashes would kill a training run.

GSM8K answers are plain numbers, so they are compared exactly as fractions. MATH and
DAPO answers are LaTeX, compared with math-verify (symbolic and numeric equivalence,
sets, intervals, units, ...).

math-verify bounds its own work with SIGALRM, which only works in the main thread
(elsewhere it raises). Off the main thread we therefore run the check in a worker
process, where it is the main thread again, and kill that worker if it overruns: a
sympy blow-up such as 10^{10^{10}} must not stall a rollout thread.
"""
from fractions import Fraction
import json
import re
import select
import subprocess
import sys
import threading

import math_verify

KINDS = ('gsm8k', 'math', 'dapo')

# Per parse/compare step inside math-verify (SIGALRM takes whole seconds).
_TIMEOUT_S = 2
# Off the main thread: the worker's whole check (its start-up on first use, two
# parses, a few compares).
_WORKER_TIMEOUT_S = 6 * _TIMEOUT_S

_BOXED = re.compile(r'\\(?:boxed|fbox)\s*')
_NUMBER = re.compile(r'-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?')
_LATEX_FRAC = re.compile(r'\\[dt]?frac\s*\{\s*(-?\d+)\s*\}\s*\{\s*(\d+)\s*\}')
_THOUSANDS_COMMA = re.compile(r'(?<=\d),(?=\d{3}(?!\d))')
# Python-style numbers that appear in Minerva gold answers ('4.5e33', '-1./3').
_E_NOTATION = re.compile(r'(?<![\w\\.])(\d+(?:\.\d+)?)e([+-]?\d+)(?!\w)')
_TRAILING_DOT = re.compile(r'(\d)\.(?=$|[\s/),\]}])')


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (or \\fbox{...}) in text, braces balanced.

  An unclosed last box (a truncated generation) gives None rather than an older box:
  the model had not finished its final answer.
  """
  matches = list(_BOXED.finditer(text))
  if not matches:
    return None
  start = matches[-1].end()
  if not text.startswith('{', start):
    # `\boxed 5`: TeX takes the next token as the argument.
    token = re.match(r'[^\s$]+', text[start:])
    return token.group(0) if token else None
  depth = 0
  for i in range(start, len(text)):
    if text[i] == '{':
      depth += 1
    elif text[i] == '}':
      depth -= 1
      if depth == 0:
        content = text[start + 1:i].strip()
        return content or None
  return None


def _plain_numbers(text: str) -> str:
  """text with Unicode minus signs as '-', and money and percent signs and thousands commas
  removed, so that `_NUMBER` reads its numbers whole."""
  return _THOUSANDS_COMMA.sub('', re.sub(r'\\?[$%]', '', text.replace('\u2212', '-')))


def _gsm8k_number(text: str) -> str | None:
  """First number in text; money and percent signs, thousands commas and any units
  around it are ignored."""
  text = _plain_numbers(text.replace('{,}', ',').replace('\\!', ''))
  text = _LATEX_FRAC.sub(r'\1/\2', text)
  match = _NUMBER.search(text)
  if not match:
    return None
  number = match.group(0)
  try:
    Fraction(number)
  except (ValueError, ZeroDivisionError):
    return None
  return number


def extract_answer(completion: str, kind: str) -> str | None:
  """The final answer a grader would read from completion, or None if there is none.

  gsm8k: the number after the last '####' (else in the last \\boxed{}), normalised to
  a plain number string such as '-1234.5' or '3/4'. math/dapo: the raw LaTeX inside
  the last \\boxed{}.
  """
  _check_kind(kind)
  if kind != 'gsm8k':
    return last_boxed(completion)
  if '####' in completion:
    return _gsm8k_number(completion.rsplit('####', 1)[1])
  boxed = last_boxed(completion)
  return _gsm8k_number(boxed) if boxed else None


def score(completion: str, answer: str, kind: str) -> float:
  """1.0 if completion's final answer equals the gold answer, else 0.0.

  For gsm8k, answer may be the bare number or a full GSM8K solution ending in
  '#### n'; for math/dapo it is the gold LaTeX answer (without $ or \\boxed).
  Raises ValueError only for an unknown kind or an unreadable gsm8k gold answer.
  """
  predicted = extract_answer(completion, kind)
  if kind == 'gsm8k':
    return _gsm8k_equal(predicted, answer)
  if predicted is None:
    return 0.0
  if threading.current_thread() is threading.main_thread():
    return float(_latex_equivalent(predicted, answer))
  return float(_latex_equivalent_in_worker(predicted, answer))


# Reward rules a GRPO run can use (config task.reward). Each returns a float in [0, 1];
# exactly 1.0 means a correct answer (the trainer's accuracy).
REWARD_RULES = ('strict', 'lenient', 'lenient_format', 'format')
# What a wrong answer in the asked-for format earns under lenient_format: enough to tell
# GRPO's groups apart when no sample is right, far below a correct answer.
FORMAT_BONUS = 0.1
# Where a final line states its answer: after the last '=' or an "answer is/:" phrase.
_ANSWER_CUE = re.compile(r'=|\banswer\s*(?:is|:)', re.IGNORECASE)


def lenient_answer(completion: str, question: str) -> str | None:
  """The number a lenient grader reads from a gsm8k completion that skipped the '#### n'
  format: the one number stated at the end of its last non-empty line.

  On that line, after its last '=' or "answer is"/"answer:" when it has one, there must be
  exactly one distinct number (two candidates, "5 or 6", are no answer); without such a cue,
  a number that also appears in the question is read as the question restated, not answered.
  A '#### n' or boxed answer, when present, is read as `extract_answer` reads it.
  """
  strict = extract_answer(completion, 'gsm8k')
  if strict is not None:
    return strict
  lines = [line for line in completion.splitlines() if line.strip()]
  if not lines:
    return None
  cues = list(_ANSWER_CUE.finditer(lines[-1]))
  segment = lines[-1][cues[-1].end():] if cues else lines[-1]
  numbers = _numbers(segment)
  if len(numbers) != 1:
    return None
  (number,) = numbers
  if not cues and number in _numbers(question):
    return None
  return str(number)


def _numbers(text: str) -> set[Fraction]:
  """The distinct numeric values in text (thousands commas, $ and % ignored)."""
  values = set()
  for match in _NUMBER.finditer(_plain_numbers(text)):
    try:
      values.add(Fraction(match.group(0).rstrip('.')))
    except (ValueError, ZeroDivisionError):
      continue
  return values


def reward(rule: str, completion: str, answer: str, kind: str, question: str) -> float:
  """The reward of `completion` under `rule` (REWARD_RULES); `question` is the prompt text.

  strict: `score` (the '#### n' or boxed answer equals the gold one). lenient: gsm8k answers
  read by `lenient_answer`, math/dapo as strict (their answers are LaTeX in a box).
  lenient_format: lenient, plus FORMAT_BONUS for a wrong answer given in the asked-for format.
  format: 1.0 for any answer in the asked-for format, right or wrong (a format-only signal).
  """
  if rule not in REWARD_RULES:
    raise ValueError(f'unknown reward rule {rule!r}; expected one of {REWARD_RULES}')
  formatted = extract_answer(completion, kind) is not None
  if rule == 'format':
    return float(formatted)
  if rule == 'strict' or kind != 'gsm8k':
    correct = score(completion, answer, kind)
  else:
    correct = _gsm8k_equal(lenient_answer(completion, question), answer)
  if rule == 'lenient_format' and not correct and formatted:
    return FORMAT_BONUS
  return correct


def _gsm8k_equal(predicted: str | None, answer: str) -> float:
  """1.0 if the predicted number equals the gsm8k gold answer (a bare number or a solution
  ending in '#### n'), else 0.0."""
  gold = extract_answer(answer, 'gsm8k') if '####' in answer else _gsm8k_number(answer)
  if gold is None:
    raise ValueError(f'gsm8k gold answer has no number: {answer!r}')
  return float(predicted is not None and Fraction(predicted) == Fraction(gold))


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f'unknown reward kind {kind!r}; expected one of {KINDS}')


def _clean_latex(latex: str) -> str:
  """Rewrites what math-verify misreads: '~' spaces (it drops units only after a
  real space), e-notation and bare trailing decimal points."""
  latex = latex.replace('~', ' ')
  latex = _E_NOTATION.sub(r'\1\\times 10^{\2}', latex)
  return _TRAILING_DOT.sub(r'\1', latex)


def _latex_equivalent(predicted: str, gold: str) -> bool:
  # Wrapping both in \boxed makes math-verify take the whole string as the answer
  # instead of searching it for some other LaTeX fragment.
  config = [math_verify.LatexExtractionConfig()]
  gold_parsed, predicted_parsed = (
      math_verify.parse(f'\\boxed{{{_clean_latex(latex)}}}', extraction_config=config,
                        parsing_timeout=_TIMEOUT_S)
      for latex in (gold, predicted))
  # allow_set_relation_comp: '0 \le x \le 1' answers a gold '[0, 1]'.
  return math_verify.verify(gold_parsed, predicted_parsed, allow_set_relation_comp=True,
                            timeout_seconds=_TIMEOUT_S)


class _Worker:
  """This file run as a script in a child process, answering one check per line.

  A fresh interpreter, not multiprocessing: spawn would re-run the caller's __main__
  and fork is unsafe next to JAX's threads. -P keeps specroll_jax/ off sys.path.
  """

  def __init__(self):
    self._proc = subprocess.Popen([sys.executable, '-P', __file__], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)

  def check(self, predicted: str, gold: str) -> bool:
    self._proc.stdin.write(json.dumps([predicted, gold]) + '\n')
    self._proc.stdin.flush()
    ready, _, _ = select.select([self._proc.stdout], [], [], _WORKER_TIMEOUT_S)
    if not ready:
      raise TimeoutError('math-verify worker overran')
    return json.loads(self._proc.stdout.readline())

  def kill(self) -> None:
    self._proc.kill()
    self._proc.wait()


def _serve() -> None:
  for line in sys.stdin:
    print(json.dumps(_latex_equivalent(*json.loads(line))), flush=True)


_worker_lock = threading.Lock()
_worker = None


def _latex_equivalent_in_worker(predicted: str, gold: str) -> bool:
  global _worker
  # One worker for all threads: sympy holds the GIL anyway, so parallel workers would
  # buy little, and a single one is simple to kill and replace when it hangs.
  with _worker_lock:
    if _worker is None:
      _worker = _Worker()
    try:
      return _worker.check(predicted, gold)
    except (OSError, ValueError):  # Overran (TimeoutError is an OSError) or died.
      _worker.kill()
      _worker = None
      return False


if __name__ == '__main__':
  _serve()
