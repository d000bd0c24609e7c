"""Character-level tokenizer for the tiny MoE policies, built in code (no hub, no files).

One token per character keeps the synthetic tasks' answers exactly aligned with tokens, so a reward of
"digits correct and in place" maps onto individual sampled tokens. The alphabet is fixed (not derived from
a task) so that a checkpoint trained on one task tokenises every other task the same way.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK)
ALPHABET = string.digits + string.ascii_lowercase + string.ascii_uppercase + " +-*/=()[],.:;?!#<>'\"$%&_\n"


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A `PreTrainedTokenizerFast` with one id per character of `alphabet` after the four special tokens.

    Left padding: prompts are padded on the left so that every sequence's completion starts at the same
    column, which is what batched generation with a KV cache expects.
    """
    if len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet has repeated characters: {alphabet!r}")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in alphabet:
        vocab[char] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, eos_token=EOS, bos_token=BOS, unk_token=UNK, padding_side="left"
    )
    return tokenizer
