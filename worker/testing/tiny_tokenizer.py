"""A small byte-level BPE tokenizer trained locally on built-in text, with a ChatML-style chat template (that lists
tools when given).

Saved with transformers' fast-tokenizer wrapper so `AutoTokenizer.from_pretrained(dir)` loads it offline.
Byte-level means any text encodes (no unknown tokens) and every token decodes.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, IM_START, IM_END, PAD = "<|begin_of_text|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, PAD]
VOCAB_SIZE = 512

# Tools, when given, come first as a system turn of their JSON (the way Qwen's templates list them), so that the
# tests of tool calling see them reach the prompt; without tools the prompt is as it always was.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Written for this file: varied English with numbers and punctuation, enough for a few hundred merges.
TRAINING_TEXT = """
The tide comes in twice a day, and the harbour master writes the times on a slate by the door.
Boats wait at the mouth of the river until the water is deep enough to carry them over the bar.
A model server is a little like that harbour: requests arrive, wait their turn, and leave when done.
Each request brings a prompt; the server reads it once, keeps what it learned in a cache of blocks,
and then writes one new word at a time until it is told to stop or runs out of room.
On Monday 3 ships came in, on Tuesday 12, and on Friday 27 small boats sailed out before noon.
Why do we batch? Because the engine can serve many sequences in the same step for nearly the price of one.
Questions, answers, lists: one, two, three; red, green, blue; north, south, east and west.
She said "hello" and he said "good morning", then both of them laughed at the weather.
Numbers like 1024, 4096 and 65536 appear in every system that counts memory in powers of two.
The quick brown fox jumps over the lazy dog while the cat watches from the warm window sill.
When the cache is full, the newest guest gives up its room and comes back later to start again.
Reading, writing and arithmetic; hardware, software and the people who keep them running at night.
""".strip().splitlines()


def build_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def save_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(out_dir)
    return tokenizer
