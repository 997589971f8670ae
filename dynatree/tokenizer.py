"""Byte-level BPE tokenizers in the Pythia style (used by ``train-pair`` and the tests)."""
from __future__ import annotations

from collections.abc import Iterable

EOS_TOKEN = "<|endoftext|>"


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE tokenizer; returns a transformers ``PreTrainedTokenizerFast``.

    Token 0 is ``<|endoftext|>`` (EOS, BOS and UNK, as in Pythia).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   unk_token=EOS_TOKEN)
