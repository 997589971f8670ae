"""Temperature sampling by coupled Gumbel-max draws: a sampled generation is a function of its seed.

Terms (every distribution is after the same temperature / top-k / top-p warping):

* ``j``       a generated token's index in its generation (0 = the token the prefill produces);
* ``g_j``     Gumbel noise for index j, one value per vocabulary entry, a fixed function of
              (seed, prompt, j): ``-log(-log(U))`` with U a hash of (key, j, entry), the key the
              seed mixed with a hash of the prompt's token ids (:func:`gumbel`, :func:`noise_key`);
* ``s(x)``    the *perturbed scores* ``warp(logits) + g_j``: logits times 1 / T (rounded, then
              the noise added), -inf outside the top-k / top-p set;
* the token at index j is ``argmax s`` over the target's logits at that position.

By the Gumbel-max trick that argmax is an exact draw from ``softmax(warp(logits) / T)``, and it
is a deterministic function of the target's logits and ``g_j``.  Speculative decoding then needs
no rejection sampling: the target's choice at every tree node is its perturbed argmax with the
noise of the index that node predicts, and acceptance is exactly greedy acceptance (the longest
drafted path that agrees with those choices, then the choice after it).  So, as in greedy
decoding, every method commits the very tokens ``ar`` would with the same seed -- whatever the
draft, the tree's shape, the hardware budget or the batch -- and exactness is testable token for
token against ``ar``.

The draft proposes the top-k of *its* perturbed scores with the same noise (a coupling: the
closer its distribution to the target's, the likelier the target's draw is among them; measured
on the bench pair at T = 0.6-1.0: top-1 agrees 72-77% of the time against 77-82% for the optimal
single-draw coupling, top-2 87-91%, top-4 95-98%), with the softmax of those perturbed scores as
its confidence (near-calibrated there: AUC 0.76 for acceptance, against 0.62 for the draft
probability of the proposal).
"""
from __future__ import annotations

import hashlib
import struct

import torch

from . import native
from .runtime import Perturb

_MASK64 = (1 << 64) - 1


def _mix(seed: int, j: int) -> int:
    """splitmix64 of (seed, j): the 64-bit key of generated index j's noise, stable across runs."""
    z = (seed * 0x9E3779B97F4A7C15 + (j + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def noise_key(seed: int, prompt=()) -> int:
    """A generation's noise key: the seed mixed with a 64-bit hash of its prompt's token ids (no
    prompt: the seed; the ids as little-endian int64, so every machine draws alike).  Why the
    prompt: with noise keyed by the seed alone, distinct prompts drawn with one seed (every
    `generate` call at the default seed 0) shared their noise, and similar prompts came out
    nearly the same text (README, *Sampling*).  A seed still reproduces a prompt's sample, and an
    ``ar`` reference (the same prompt ids, the same seed) draws with the same noise."""
    if len(prompt) == 0:
        return seed
    h = hashlib.blake2b(struct.pack(f"<{len(prompt)}q", *prompt), digest_size=8).digest()
    return seed ^ int.from_bytes(h, "little")


def sample_seed(seed: int, sample: int) -> int:
    """The seed of a prompt's sample number ``sample`` (generate_batch's ``samples``): sample 0
    draws with ``seed`` itself, so a single sample is the plain generation."""
    return seed if sample == 0 else _mix(seed, -1 - sample)  # j < 0: no generated index's noise key


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finalizer on int64 tensors holding 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def gumbel(key: int, width: int) -> torch.Tensor:
    """(width,) float32 Gumbel noise for a 64-bit key: csrc/neox.c's dt_gumbel (its comment has the
    construction and its precision), or the same formulas in torch where the C library does not
    build (equal up to the last bits of the logarithms)."""
    k0, k1 = key & 0xFFFFFFFF, key >> 32
    g = native.gumbel(k0, k1, width)
    if g is not None:
        return g
    h = _fmix32(((_fmix32(torch.arange(width) ^ k0) + k1) & 0xFFFFFFFF))
    v = ((h >> 1).float() + 0.25) * 2.0 ** -31
    v = v.clamp_(max=1 - 2.0 ** -24)
    u = 1 - v
    e = torch.where(u == 1, v, u.log() * v / (u - 1))  # -log1p(-v), as the C code computes it
    return e.log_().neg_()


def in_head(sampler: "Sampler | None") -> bool:
    """Whether a forward's own argmax / top-k head gives the answer: greedy (no sampler), or
    sampling with temperature alone, whose noise the head reads (:func:`head`).  Otherwise (top-k /
    top-p masks) the caller takes :meth:`Sampler.choose` / :meth:`Sampler.propose` on the logits."""
    return sampler is None or sampler.plain


def head(sampler: "Sampler | None", depths: list[int]) -> Perturb | None:
    """The runtime.Perturb a forward's heads read for kept rows at these depths below the root, or
    None where they read the plain logits."""
    return sampler.head(depths) if sampler is not None and sampler.plain else None


class Sampler:
    """Warping and the seeded noise of one generation.  ``temperature == 0`` never builds one.

    ``base`` is the index of the next token to commit (the engine sets it each iteration); a
    tree node at depth d predicts index ``base + d``."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int, prompt=()):
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.key = noise_key(seed, prompt)  # prompt: the generation's prompt token ids
        self.base = 0
        self._noise: dict[int, torch.Tensor] = {}  # j -> (V,) Gumbel noise, while j may still be drafted

    @classmethod
    def from_config(cls, cfg, prompt=()) -> "Sampler | None":
        return cls(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, prompt) if cfg.temperature > 0 else None

    def at(self, base: int) -> None:
        """The next token to commit has index ``base``; noise of earlier indices is dropped."""
        self.base = base
        for j in [j for j in self._noise if j < base]:
            del self._noise[j]

    def noise(self, j: int, width: int, like: torch.Tensor | None = None) -> torch.Tensor:
        """g_j: (width,), the same on every device and run (computed on the CPU, then kept in
        ``like``'s dtype and device, where the scores are added up)."""
        g = self._noise.get(j)
        if g is None or g.shape[0] < width:
            g = gumbel(_mix(self.key, j), width)  # (width,)
            if like is not None:
                g = g.to(device=like.device, dtype=like.dtype)
            self._noise[j] = g
        return g[:width]

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (n, V) -> (n, V) logits over the temperature, -inf outside top-k / top-p."""
        x = (logits if logits.dtype == torch.float64 else logits.float()) * (1.0 / self.temperature)  # a new tensor
        if 0 < self.top_k < x.shape[-1]:
            kth = x.topk(self.top_k, dim=-1).values[:, -1:]  # (n, 1)
            x = x.masked_fill(x < kth, -torch.inf)
        if self.top_p < 1.0:
            srt, idx = x.sort(dim=-1, descending=True)
            sp = srt.softmax(-1)
            drop = sp.cumsum(-1) - sp >= self.top_p  # the mass before this token already reaches top_p
            drop[:, 0] = False  # the likeliest always stays (a top_p below float32's least reads as 0)
            x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), -torch.inf)
        return x

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: (n, V) -> (n, V) the warped distribution the draws follow."""
        return self.warp(logits).softmax(-1)

    def scores(self, logits: torch.Tensor, depths: list[int]) -> torch.Tensor:
        """logits: (n, V) at nodes of the given depths -> (n, V) perturbed scores s.  Nodes come
        level by level (BFS), so each run of equal depths takes its noise in one add."""
        x = self.warp(logits)
        width, a = x.shape[-1], 0
        while a < len(depths):
            b = a + 1
            while b < len(depths) and depths[b] == depths[a]:
                b += 1
            x[a:b].add_(self.noise(self.base + depths[a], width, x))
            a = b
        return x

    @property
    def plain(self) -> bool:
        """Temperature alone: the forward's own heads take the noise (:meth:`head`); top-k / top-p
        masks need :meth:`choose` and :meth:`propose` on the logits."""
        return not self.top_k and self.top_p >= 1.0

    def head(self, depths: list[int]) -> Perturb:
        """What a forward's heads read for kept rows at these depths (runtime.Perturb): their
        argmax is :meth:`choose`'s draw, their softmax top-k :meth:`propose`'s proposals."""
        js = [self.base + d for d in depths]
        return Perturb(1.0 / self.temperature, lambda width: [self.noise(j, width) for j in js])

    def choose(self, logits: torch.Tensor, depths: list[int]) -> list[int]:
        """logits: (n, V) -> each row's draw (its perturbed argmax).  Host sync."""
        return choose_each([self], [logits], [depths])[0]

    def propose(self, logits: torch.Tensor, depths: list[int], k: int) -> tuple[list[list[float]], list[list[int]]]:
        """A draft's k proposals per row: the top-k of its perturbed scores, with their softmax as
        confidences (host lists; proposals outside top-k / top-p are dropped).  Host sync."""
        return propose_each([self], [logits], [depths], [k])[0]


def _split(rows: list, sizes: list[int]) -> list[list]:
    out, r = [], 0
    for n in sizes:
        out.append(rows[r:r + n])
        r += n
    return out


def choose_each(samplers: list[Sampler], logits: list[torch.Tensor], depths: list[list[int]]) -> list[list[int]]:
    """Several sequences' :meth:`Sampler.choose` (logits[i]: (n_i, V) at depths[i]) read back in
    one host sync: on a GPU each read is a wait, and a batch has many sequences."""
    scores = [s.scores(x, d) for s, x, d in zip(samplers, logits, depths)]
    return _split(native.argmax_rows(torch.cat(scores)), [len(d) for d in depths])


def propose_each(samplers: list[Sampler], logits: list[torch.Tensor], depths: list[list[int]],
                 ks: list[int]) -> list[tuple[list[list[float]], list[list[int]]]]:
    """Several sequences' :meth:`Sampler.propose` (k = ks[i] each) in one host sync."""
    scores = torch.cat([s.scores(x, d) for s, x, d in zip(samplers, logits, depths)])
    vals, ids = native.topk_probs(scores, min(max(ks), scores.shape[-1]))
    for r in range(len(vals)):
        n_in = sum(1 for v in vals[r] if v > 1e-30)  # masked tokens score -inf
        vals[r], ids[r] = vals[r][:n_in], ids[r][:n_in]
    sizes = [len(d) for d in depths]
    return [([v[:k] for v in vs], [t[:k] for t in ts])
            for vs, ts, k in zip(_split(vals, sizes), _split(ids, sizes), ks)]
