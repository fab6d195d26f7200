"""Prompts enter as raw text for base models, or as one user turn through a chat template."""
import dataclasses

import pytest

from specroll_jax.tasks import data
from specroll_jax.tasks.sources import load_tasks
from tests.conftest import FIXTURE_DATA

# A ChatML-style template, as SmolLM2-Instruct's tokenizer carries.
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_base_models_keep_raw_prompts_and_instruct_models_get_a_user_turn(stories_policy):
  text = 'Tom has 3 apples.'
  assert stories_policy.prompt_ids(text, chat_template=False) == (
      stories_policy.tokenizer.encode(text))
  with pytest.raises(ValueError, match='has none'):
    stories_policy.prompt_ids(text, chat_template=True)
  tokenizer = stories_policy.tokenizer.__class__.from_pretrained(
      stories_policy.tokenizer.name_or_path)
  tokenizer.chat_template = CHATML
  instruct = dataclasses.replace(stories_policy, tokenizer=tokenizer)
  ids = instruct.prompt_ids(text, chat_template=True)
  rendered = '<|im_start|>user\nTom has 3 apples.<|im_end|>\n<|im_start|>assistant\n'
  assert ids == tokenizer.encode(rendered, add_special_tokens=False)
  assert ids == tokenizer.apply_chat_template([{'role': 'user', 'content': text}],
                                              add_generation_prompt=True, tokenize=True,
                                              return_dict=True)['input_ids']


def test_chat_task_prompts_ask_for_the_answer_format_the_reward_reads():
  gsm8k = data.load_dataset('gsm8k', FIXTURE_DATA, split='test', chat=True).examples[0]
  assert gsm8k.prompt.endswith("End your answer with '#### <number>', where <number> is the "
                               'final numerical answer.')
  assert 'Question:' not in gsm8k.prompt and 'Answer:' not in gsm8k.prompt
  raw = data.load_dataset('gsm8k', FIXTURE_DATA, split='test').examples[0]
  assert raw.prompt.startswith('Question:\n') and raw.answer == gsm8k.answer
  synthetic = load_tasks('synthetic:easy', count=2, seed=0, chat=True)
  assert all(t.prompt.endswith("'#### <number>', where <number> is the final numerical answer.")
             for t in synthetic)
  assert load_tasks('synthetic:easy', count=2, seed=0)[0].prompt.startswith('Question: ')
