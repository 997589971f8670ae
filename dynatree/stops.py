"""Stop rules besides EOS and ``max_new_tokens``: stop strings and stop token ids (vLLM's ``stop`` /
``stop_token_ids``).

A generation ends at the first generated token after which

* that token is one of ``token_ids`` (kept, as EOS is), or
* the generated text -- the generated tokens decoded as the output's text is (special tokens
  written out), the prompt not included -- contains one of ``strings``; the token completing it
  is the last token, and the returned text ends just before the string (:meth:`Stop.cut`).

The rule looks only at committed tokens, one at a time in order, so a tree method that accepts
several tokens in one iteration stops at the same token ``ar`` stops at: the outputs stay equal.
"""
from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass


def _as_id(t):
    """An id as a Python int where it is an integer of any kind (numpy's); else as it was, to be refused."""
    try:
        return t if isinstance(t, bool) else operator.index(t)
    except TypeError:
        return t


@dataclass(frozen=True)
class Stop:
    """When a row's generation stops before its length: at any of ``strings`` in its text (the text
    ends before it; the token ids keep the token that completed it) or any of ``token_ids`` (as at
    EOS).  ``Stop.of`` takes the user-facing forms (a string, an id, lists of them)."""

    strings: tuple[str, ...] = ()
    token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.strings, (tuple, list)) or not isinstance(self.token_ids, (tuple, list)):
            raise ValueError(f"Stop takes a tuple of strings and a tuple of token ids, got {self.strings!r} and "
                             f"{self.token_ids!r} (Stop.of, like generate's stop=, also takes a single one)")
        object.__setattr__(self, "strings", tuple(self.strings))  # (lists: a frozen, hashable rule all the same)
        object.__setattr__(self, "token_ids", tuple(_as_id(t) for t in self.token_ids))  # (numpy ids: as Stop.of)
        if not all(isinstance(s, str) and s for s in self.strings):
            raise ValueError(f"stop strings must be non-empty strings, got {self.strings!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.token_ids):
            raise ValueError(f"stop token ids must be whole numbers >= 0, got {self.token_ids!r}")

    @classmethod
    def of(cls, strings=None, token_ids=None) -> "Stop | None":
        """From the user-facing forms (a string or strings; an id or ids, numpy integers
        included); a Stop as it is; None if empty."""
        if isinstance(strings, Stop) and token_ids is None:
            return strings
        if isinstance(strings, Stop):  # with more ids: the Stop's and those
            extra = cls.of(None, token_ids)
            strings, token_ids = strings.strings, strings.token_ids + (extra.token_ids if extra else ())
        if isinstance(strings, (bytes, bytearray)):
            raise ValueError(f"a stop string is bytes ({bytes(strings)!r}): pass text (.decode() it)")
        if strings is not None and not isinstance(strings, str) and not hasattr(strings, "__iter__"):
            raise ValueError(f"stop must be a string or strings, got {strings!r}")
        strings = (strings,) if isinstance(strings, str) else tuple(strings or ())
        ids = () if token_ids is None else (token_ids,) if not hasattr(token_ids, "__iter__") else tuple(token_ids)
        try:
            ids = tuple(t if isinstance(t, bool) else operator.index(t) for t in ids)
        except TypeError:
            raise ValueError(f"stop token ids must be whole numbers >= 0, got {token_ids!r}") from None
        stop = cls(strings, ids)
        return stop if stop.strings or stop.token_ids else None

    def check_vocab(self, vocab: int) -> None:
        """A stop id the models can never produce is a mistake: say so."""
        if any(t >= vocab for t in self.token_ids):
            raise ValueError(f"stop token ids {sorted(t for t in self.token_ids if t >= vocab)} are outside the "
                             f"models' vocabulary (0 .. {vocab - 1})")

    def cut(self, text: str) -> str:
        """``text`` up to the first stop string in it (all of it if none occurs)."""
        found = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return text[:min(found)] if found else text

    def watch(self, decode: Callable[[list[int]], str]) -> Callable[[list[int]], bool]:
        """A check to call after each token appended to ``out``: whether the rule ends it there."""
        ids, strings = frozenset(self.token_ids), self.strings
        # The text a stop string ends in comes from the last few tokens: every token is at least one
        # byte of text, so the last len(bytes) + 4 tokens hold it, with room for a slice that starts
        # inside a multi-byte character (decoded as U+FFFD) or loses a leading space.
        tail = max((len(s.encode()) for s in strings), default=0) + 4

        def hit(out: list[int]) -> bool:
            if out[-1] in ids:
                return True
            if not strings:
                return False
            piece = decode(out[-tail:])  # (a slice that starts inside a character may read U+FFFDs for
            if "\ufffd" not in piece and not any(s in _whole(piece) for s in strings):  # a whole byte run)
                return False
            return any(s in _whole(decode(out)) for s in strings)  # the whole text decides (a slice may err)
        return hit


def _whole(text: str) -> str:
    """The text less a character still coming: bytes of an unfinished UTF-8 character decode as
    U+FFFD, which a stop string "\ufffd" matched halfway through an emoji (the text trial)."""
    return text.rstrip("\ufffd")


def text_of(decode: Callable[[list[int]], str], ids: list[int], reason: str, stop: Stop | None) -> str:
    """A generation's text: its tokens decoded, ending before the stop string that ended it -- or
    that its EOS token completed (``--stop '<|endoftext|>'``: EOS is tested first, and the string had
    stayed in the text); one inside the EOS token's text alone ("end" in "<|endoftext|>") is no cut."""
    text = decode(ids)
    if stop is None or reason not in ("stop", "eos"):
        return text
    if reason == "eos":  # (an earlier appearance would have stopped the row: this one ends in the EOS text)
        found = [i for i in (text.find(s) for s in stop.strings) if i >= 0]
        if not found or min(found) > len(decode(ids[:-1])):
            return text
    return stop.cut(text)


def texts_changed(pair, stop: Stop | None) -> bool:
    """Whether dynatree before 2026-12-01 could have written a job's texts otherwise (a resume must
    not mix the two: plan.pin_text_rule): ``pair``'s tokenizer drops the leading space of a
    continuation decoded alone (SentencePiece), or a stop string lies in an EOS token's text or is
    U+FFFD (cut, and held back, since)."""
    if getattr(pair, "tokenizer", None) is None:
        return False
    ids = pair.encode("a b")
    seam = len(ids) > 1 and pair.decoder(ids[:1])(ids[1:]) != pair.decode(ids[1:])
    eos = [pair.decode([e]) for e in pair.eos_token_ids]
    ends_in = lambda s, t: s in t or any(t.startswith(s[i:]) for i in range(1, len(s)))  # noqa: E731 (".<|endof")
    return seam or any("\ufffd" in s or any(ends_in(s, t) for t in eos) for s in (stop.strings if stop else ()))
