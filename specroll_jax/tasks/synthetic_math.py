"""Seeded multi-step arithmetic word problems with verifiable integer answers (GSM8K format).

The embedded default task (workload W1): a small policy is pretrained on it from scratch
(specroll_jax.pretrain) and post-trained with GRPO, so nothing has to be downloaded. A
problem is a short story (a person, an object, a starting amount changed by + - * and exact
/ operations) whose solution shows one computation per line ('12 + 5 = 17') and ends with
'#### <answer>', which rewards.score(completion, answer, 'gsm8k') reads. Every amount is a
positive integer, so every answer is exact.
"""
import dataclasses
import random


@dataclasses.dataclass(frozen=True)
class Problem:
  question: str
  solution: str  # One 'a op b = c' line per operation, then '#### <answer>'.
  answer: str    # The final amount as text: the gold answer for rewards.score.


@dataclasses.dataclass(frozen=True)
class Difficulty:
  step_weights: tuple  # relative frequency of problems with 1, 2, 3, ... operations
  max_start: int       # largest starting amount (and amount per box)
  max_addend: int      # largest amount added or taken away
  max_factor: int      # largest multiplier, divisor or number of boxes
  max_value: int       # no amount along the way exceeds this


# Calibrated on the default W1 pretraining (pretrain.PretrainConfig: 2400 steps, 7 minutes
# on an idle 2-core CPU), greedy on held-out problems: 98% of easy and 62% of hard ones
# solved, so GRPO on hard problems starts with reward signal and room to improve. A run cut
# short by a busy CPU solves fewer (1340 steps: 59% and 13%).
SPLITS = {
    'easy': Difficulty(step_weights=(0.4, 0.45, 0.15), max_start=20, max_addend=10,
                       max_factor=3, max_value=40),
    'hard': Difficulty(step_weights=(0.0, 0.0, 0.5, 0.5), max_start=30, max_addend=20,
                       max_factor=5, max_value=100),
}

# How often the story opens with boxes of objects, which is itself a multiplication step.
_BOX_OPENING = 0.25

# Names, objects and wording are chosen for short token sequences under the 512-token
# stories260K tokenizer (most words cost one token per few letters): every question token is
# compute the small pretrained policy spends without learning arithmetic from it.
_NAMES = (('Lily', 'she'), ('Tim', 'he'), ('Ben', 'he'), ('Sam', 'he'), ('Tom', 'he'),
          ('Mia', 'she'), ('Sue', 'she'), ('Amy', 'she'), ('Max', 'he'), ('Kim', 'she'))
_OBJECTS = ('balls', 'beads', 'cars', 'dolls', 'fish', 'hats', 'shells', 'stars', 'toys',
            'apples', 'books', 'cakes', 'cards', 'coins', 'eggs', 'rocks')
_OPENINGS = ('{name} has {n} {obj}.', '{name} starts with {n} {obj}.')
_BOX_OPENINGS = ('{name} has {boxes} boxes of {obj} with {n} in each box.',
                 '{name} buys {boxes} bags with {n} {obj} in each bag.')
_TEMPLATES = {
    '+': ('{Pron} gets {n} more.', '{Pron} finds {n} more.'),
    '-': ('{Pron} loses {n}.', '{Pron} gives {n} to a friend.'),
    '*': ('Then {pron} has {n} times as many.', 'Now {pron} has {n} times as many.'),
    '/': ('{Pron} splits them into {n} equal piles and keeps one.',
          '{Pron} puts them in {n} equal bags and keeps one bag.'),
}
_QUESTIONS = ('How many does {pron} have now?', 'How many {obj} are left?')


def prompt(question: str) -> str:
  """The prompt text the policy sees, shared by pretraining and the GRPO trainer."""
  return f'Question: {question}\nAnswer:\n'


def _operations(value: int, d: Difficulty) -> dict:
  """Operation -> operands that keep every amount a positive integer <= max_value."""
  factors = range(2, d.max_factor + 1)
  ops = {'+': range(1, min(d.max_addend, d.max_value - value) + 1),
         '-': range(1, min(d.max_addend, value - 1) + 1),
         '*': [f for f in factors if value * f <= d.max_value],
         '/': [f for f in factors if value % f == 0]}
  return {op: operands for op, operands in ops.items() if len(operands)}


def make_problem(d: Difficulty, rng: random.Random) -> Problem:
  name, pron = rng.choice(_NAMES)
  names = dict(name=name, pron=pron, Pron=pron.capitalize(), obj=rng.choice(_OBJECTS))
  steps = rng.choices(range(1, len(d.step_weights) + 1), weights=d.step_weights)[0]
  if rng.random() < _BOX_OPENING:
    boxes = rng.randint(2, d.max_factor)
    each = rng.randint(2, min(d.max_start, d.max_value // boxes))
    value = boxes * each
    sentences = [rng.choice(_BOX_OPENINGS).format(boxes=boxes, n=each, **names)]
    lines = [f'{boxes} * {each} = {value}']
    steps -= 1
  else:
    value = rng.randint(2, d.max_start)
    sentences = [rng.choice(_OPENINGS).format(n=value, **names)]
    lines = []
  for _ in range(steps):
    ops = _operations(value, d)
    op = rng.choice(sorted(ops))
    n = rng.choice(ops[op])
    result = {'+': value + n, '-': value - n, '*': value * n, '/': value // n}[op]
    sentences.append(rng.choice(_TEMPLATES[op]).format(n=n, **names))
    lines.append(f'{value} {op} {n} = {result}')
    value = result
  sentences.append(rng.choice(_QUESTIONS).format(**names))
  return Problem(question=' '.join(sentences), solution='\n'.join(lines + [f'#### {value}']),
                 answer=str(value))


def make_problems(split: str, count: int, seed: int) -> list[Problem]:
  """`count` problems of `split` ('easy' or 'hard'); the same (split, seed) gives the same list."""
  if split not in SPLITS:
    raise ValueError(f'unknown split {split!r}; expected one of {sorted(SPLITS)}')
  # A string seed gives each split its own stream (str seeds hash with sha512: stable).
  rng = random.Random(f'{split}/{seed}')
  return [make_problem(SPLITS[split], rng) for _ in range(count)]
