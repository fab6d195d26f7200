"""Reward grading: each expected value is what a careful human grader would give."""
import threading
import time

import pytest

from specroll_jax.tasks import rewards

GSM = 'gsm8k'
MATH = 'math'
DAPO = 'dapo'

# (completion, gold, kind, expected)
CASES = [
    # GSM8K: the number after the last '####'.
    ('She has 3 + 4 = 7 apples.\n#### 7', '7', GSM, 1.0),
    ('#### 1,234', '1234', GSM, 1.0),
    ('#### 1,234,567', '1234567', GSM, 1.0),
    ('Total: $1,234.00\n#### $1,234.00', 'So 1200+34 = <<1200+34=1234>>1234\n#### 1234', GSM, 1.0),
    ('#### 18 dollars', '18', GSM, 1.0),
    ('#### 18 dollars', '19', GSM, 0.0),
    ('#### 50%', '50', GSM, 1.0),
    ('#### -5', '-5', GSM, 1.0),
    ('#### \u22125', '-5', GSM, 1.0),
    ('She is $5 short.\n#### -$5', '-5', GSM, 1.0),
    ('#### 5', '-5', GSM, 0.0),
    ('#### 2.50', '2.5', GSM, 1.0),
    ('#### 0.5', '1/2', GSM, 1.0),
    ('#### \\frac{3}{4}', '0.75', GSM, 1.0),
    ('#### 18.', '18', GSM, 1.0),
    ('First guess #### 12\nCheck again... #### 15', '15', GSM, 1.0),
    ('First guess #### 15\nCheck again... #### 12', '15', GSM, 0.0),
    ('####\n42', '42', GSM, 1.0),
    ('The answer is 42.', '42', GSM, 0.0),
    ('####', '42', GSM, 0.0),
    ('#### forty-two', '42', GSM, 0.0),
    ('#### 3/0', '3', GSM, 0.0),
    ('So the answer is \\boxed{42}.', '42', GSM, 1.0),
    ('So the answer is \\boxed{\\$1,234}.', '1234', GSM, 1.0),
    ('#### 1234', '#### 1,234', GSM, 1.0),
    # MATH: the last \boxed{...} against LaTeX gold answers.
    ('Thus $x = \\boxed{\\frac{1}{2}}$.', '\\frac12', MATH, 1.0),
    ('\\boxed{\\dfrac{1}{2}}', '\\frac{1}{2}', MATH, 1.0),
    ('\\boxed{\\tfrac{2}{3}}', '\\frac{2}{3}', MATH, 1.0),
    ('\\boxed{2/3}', '\\frac{2}{3}', MATH, 1.0),
    ('\\boxed{0.5}', '\\frac{1}{2}', MATH, 1.0),
    ('\\boxed{.5}', '\\frac{1}{2}', MATH, 1.0),
    ('\\boxed{1.5}', '\\frac{3}{2}', MATH, 1.0),
    ('\\boxed{\\frac{7}{2}}', '3\\frac{1}{2}', MATH, 1.0),
    ('\\boxed{0.67}', '\\frac{2}{3}', MATH, 0.0),
    ('\\boxed{\\frac{1}{2}}', '-\\frac{1}{2}', MATH, 0.0),
    ('\\boxed{\\frac{-1}{2}}', '-\\frac{1}{2}', MATH, 1.0),
    ('\\boxed{-5}', '-5', MATH, 1.0),
    ('\\boxed{-5}', '5', MATH, 0.0),
    ('First \\boxed{3}, but on reflection \\boxed{5}.', '5', MATH, 1.0),
    ('First \\boxed{5}, but on reflection \\boxed{3}.', '5', MATH, 0.0),
    ('The answer is \\boxed{\\frac{\\sqrt{3}}{2}} as claimed.', '\\frac{\\sqrt3}2', MATH, 1.0),
    ('\\boxed{2\\sqrt{2}}', '\\sqrt{8}', MATH, 1.0),
    ('\\boxed{\\dfrac{\\sqrt{2}}{2}}', '\\frac{1}{\\sqrt{2}}', MATH, 1.0),
    ('\\boxed{\\sqrt{2}/2}', '\\frac{\\sqrt{2}}{2}', MATH, 1.0),
    ('\\boxed{\\sqrt[3]{8}}', '2', MATH, 1.0),
    ('\\boxed{1.414}', '\\sqrt{2}', MATH, 0.0),
    ('\\boxed{2\\pi}', '2\\pi', MATH, 1.0),
    ('\\boxed{6.28}', '2\\pi', MATH, 0.0),
    ('\\boxed{3.14159}', '\\pi', MATH, 0.0),
    ('\\boxed{(3, \\frac{\\pi}{2})}', '\\left( 3, \\frac{\\pi}{2} \\right)', MATH, 1.0),
    ('\\boxed{(5, 3)}', '(3, 5)', MATH, 0.0),
    ('\\boxed{[2, 5)}', '[2,5)', MATH, 1.0),
    ('\\boxed{(2, 5)}', '[2,5)', MATH, 0.0),
    ('\\boxed{(-\\infty, 0) \\cup (1, \\infty)}', '(-\\infty,0)\\cup(1,\\infty)', MATH, 1.0),
    ('\\boxed{0 \\le x \\le 1}', '[0,1]', MATH, 1.0),
    ('\\boxed{3, 5}', '5, 3', MATH, 1.0),
    ('\\boxed{x = 2 \\text{ or } x = 3}', '2, 3', MATH, 1.0),
    ('\\boxed{\\pm 1}', '-1, 1', MATH, 1.0),
    ('\\boxed{x = 5}', '5', MATH, 1.0),
    ('\\boxed{5\\text{ cm}}', '5', MATH, 1.0),
    ('\\boxed{5 \\text{cm}^2}', '5', MATH, 1.0),
    ('\\boxed{5~\\mathrm{cm}}', '5', MATH, 1.0),
    ('\\boxed{12\\text{ degrees}}', '12', MATH, 1.0),
    ('\\boxed{90^\\circ}', '90', MATH, 1.0),
    ('\\boxed{\\$42}', '42', MATH, 1.0),
    ('\\boxed{\\$1,\\!234.56}', '1234.56', MATH, 1.0),
    ('\\boxed{1{,}000}', '1000', MATH, 1.0),
    ('\\boxed{42\\%}', '42', MATH, 1.0),
    ('\\boxed{1.5 \\times 10^{3}}', '1500', MATH, 1.0),
    ('\\boxed{4.5 \\times 10^{33}}', '4.5e33', MATH, 1.0),
    ('\\boxed{-1/3}', '-1./3', MATH, 1.0),
    ('\\boxed{x^2 - 1}', '(x-1)(x+1)', MATH, 1.0),
    ('\\boxed{x^2 + 1}', '(x-1)(x+1)', MATH, 0.0),
    ('\\boxed{3+2i}', '3+2i', MATH, 1.0),
    ('\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}',
     '\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}', MATH, 1.0),
    ('\\boxed{\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}}',
     '\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}', MATH, 0.0),
    ('\\boxed{\\text{Monday}}', '\\text{Monday}', MATH, 1.0),
    ('\\boxed{\\text{Friday}}', '\\text{Monday}', MATH, 0.0),
    ('\\boxed{\\text{(C)}}', '\\text{(C)}', MATH, 1.0),
    ('\\boxed{C}', '\\text{(C)}', MATH, 1.0),
    ('\\boxed{D}', '\\text{(C)}', MATH, 0.0),
    ('\\boxed 5', '5', MATH, 1.0),
    ('\\fbox{7}', '7', MATH, 1.0),
    # No answer, or a broken one: 0.0, never an exception.
    ('The answer is 5.', '5', MATH, 0.0),
    ('', '5', MATH, 0.0),
    ('\\boxed{}', '5', MATH, 0.0),
    ('\\boxed{5} then \\boxed{5', '5', MATH, 0.0),  # Truncated final answer.
    ('\\boxed{\\frac{1}{', '1', MATH, 0.0),
    ('\\boxed{\\frac{}{}}', '1', MATH, 0.0),
    ('\\boxed{\\left(}', '1', MATH, 0.0),
    ('\\boxed{^^^}', '1', MATH, 0.0),
    ('\\boxed{\\sqrt}', '1', MATH, 0.0),
    ('\\boxed{\\begin{pmatrix}}', '1', MATH, 0.0),
    ('\\boxed{1/0}', '1', MATH, 0.0),
    ('\\boxed{}}}{{', '1', MATH, 0.0),
    # DAPO: integer answers.
    ('So $a+b+c = \\boxed{34}$.', '34', DAPO, 1.0),
    ('\\boxed{34.0}', '34', DAPO, 1.0),
    ('\\boxed{ 34 }', '34', DAPO, 1.0),
    ('\\boxed{35}', '34', DAPO, 0.0),
    ('a+b+c = 34', '34', DAPO, 0.0),
]


@pytest.mark.parametrize('completion,gold,kind,expected', CASES)
def test_score(completion, gold, kind, expected):
  assert rewards.score(completion, gold, kind) == expected


def test_extract_answer():
  assert rewards.extract_answer('x #### $1,234.50 total', 'gsm8k') == '1234.50'
  assert rewards.extract_answer('\\boxed{\\frac{1}{2}} or \\boxed{\\{1, 2\\}}', 'math') == \
      '\\{1, 2\\}'
  assert rewards.extract_answer('no answer here', 'dapo') is None


def test_unknown_kind_is_named():
  with pytest.raises(ValueError, match='aime'):
    rewards.score('\\boxed{1}', '1', 'aime')


def test_gsm8k_gold_without_number_is_an_error():
  with pytest.raises(ValueError, match='no number'):
    rewards.score('#### 1', 'unknown', 'gsm8k')


def test_runaway_comparison_is_cut_off():
  start = time.monotonic()
  assert rewards.score('\\boxed{10^{10^{10}}}', '1', 'math') == 0.0
  assert time.monotonic() - start < 5 * rewards._TIMEOUT_S


def _score_in_thread(*args):
  result = []
  thread = threading.Thread(target=lambda: result.append(rewards.score(*args)))
  thread.start()
  thread.join()
  return result[0]


def test_scores_off_the_main_thread():
  assert _score_in_thread('\\boxed{2\\sqrt{2}}', '\\sqrt{8}', 'math') == 1.0
  assert _score_in_thread('\\boxed{3}', '\\sqrt{8}', 'math') == 0.0
  assert _score_in_thread('#### 8', '8', 'gsm8k') == 1.0


def test_hung_worker_is_replaced(monkeypatch):
  monkeypatch.setattr(rewards, '_WORKER_TIMEOUT_S', 0.5)
  start = time.monotonic()
  assert _score_in_thread('\\boxed{10^{10^{10}}}', '1', 'math') == 0.0
  assert time.monotonic() - start < 2
  monkeypatch.undo()
  assert _score_in_thread('\\boxed{\\frac{1}{2}}', '0.5', 'math') == 1.0


QUESTION = 'Janet has 16 ducks and sells 3 of their eggs. How many eggs are left?'
RULE_CASES = [
    # (rule, completion, gold, reward)
    ('strict', 'She has 16 - 3 = 13 left.\n#### 13', '13', 1.0),
    ('strict', 'She has 16 - 3 = 13 left.', '13', 0.0),        # no '#### n': strict reads none
    ('lenient', 'She has 16 - 3 = 13 left.', '13', 1.0),       # after the last '='
    ('lenient', 'Work.\nThe answer is 13', '13', 1.0),
    ('lenient', 'So she has 13 eggs left.', '13', 1.0),        # one number, not the question's
    ('lenient', 'She sells 3 eggs a day.\nJanet has 16 ducks.', '16', 0.0),  # question restated
    ('lenient', 'The answer is 13 or 14.', '13', 0.0),         # two candidate answers
    ('lenient', 'It is 13.\nI am not sure.', '13', 0.0),       # the last line states nothing
    ('lenient', 'She keeps $1,300 in the end.', '1300', 1.0),
    ('lenient', 'Work.\n#### 12', '13', 0.0),                  # a strict answer is read first
    ('lenient_format', 'Work.\n#### 12', '13', rewards.FORMAT_BONUS),  # wrong, in format
    ('lenient_format', 'So she has 12 eggs left.', '13', 0.0),
    ('lenient_format', 'So she has 13 eggs left.', '13', 1.0),
    ('format', 'Work.\n#### 12', '13', 1.0),
    ('format', 'So she has 13 eggs left.', '13', 0.0),
]


@pytest.mark.parametrize('rule,completion,gold,expected', RULE_CASES)
def test_reward_rules(rule, completion, gold, expected):
  assert rewards.reward(rule, completion, gold, 'gsm8k', QUESTION) == expected


def test_lenient_reads_latex_tasks_strictly():
  # math/dapo answers are LaTeX in a box: lenient reads them as strict does.
  assert rewards.reward('lenient', 'so x = 1/2', '\\frac{1}{2}', 'math', 'Solve.') == 0.0
  assert rewards.reward('lenient', 'so \\boxed{\\frac{1}{2}}', '\\frac{1}{2}', 'math',
                        'Solve.') == 1.0


def test_unknown_rule_is_named():
  with pytest.raises(ValueError, match="unknown reward rule 'loose'"):
    rewards.reward('loose', '#### 1', '1', 'gsm8k', '')
