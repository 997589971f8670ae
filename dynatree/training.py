"""Train a small Pythia-architecture target/draft pair on CPU (``dynatree train-pair``).

Recipe: a byte-level BPE tokenizer on the corpus; a GPT-NeoX target (rotary, parallel
residual, untied embeddings, EOS ``<|endoftext|>``) trained with next-token cross-entropy for
a wall-clock budget; then a GPT-NeoX draft trained for its own budget on the same stream with
cross-entropy plus KL(target || draft), so that its greedy choices agree with the target's
(agreement, not perplexity, is what speculative decoding pays for).  Learning rates follow a
warm-up then cosine decay over the *time* budget, so a run always ends annealed.
"""
from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .tokenizer import train_bpe_tokenizer


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int


MIN_VOCAB = 260


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 4096
    target: ModelShape = ModelShape(4, 192, 4)
    draft: ModelShape = ModelShape(2, 96, 2)
    seq_len: int = 256
    batch_size: int = 16
    context: int = 1024  # max_position_embeddings of both models
    target_minutes: float = 10.0
    draft_minutes: float = 5.0
    lr: float = 2e-3
    distill_weight: float = 1.0  # weight of KL(target || draft) in the draft's loss
    heldout_fraction: float = 0.01
    max_chars: int = 40_000_000
    bf16: bool = True  # bf16 autocast: about 2x faster on CPUs with AMX
    seed: int = 0

    def __post_init__(self):  # checked before the corpus is read: a bad value must not cost a training run
        for name in ("batch_size", "seq_len", "context", "max_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len > self.context:
            raise ValueError(f"seq_len {self.seq_len} is longer than the models' context {self.context} "
                             "(max_position_embeddings): train on windows that fit")
        if self.vocab_size < MIN_VOCAB:
            raise ValueError(f"vocab_size {self.vocab_size}: a byte-level BPE needs at least {MIN_VOCAB} "
                             "(256 bytes, EOS, and merges)")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not (self.target_minutes > 0 and self.draft_minutes > 0):
            raise ValueError("target_minutes and draft_minutes must be positive (0 would save untrained models)")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        for shape in (self.target, self.draft):
            if min(shape.layers, shape.hidden, shape.heads) < 1 or shape.hidden % shape.heads:
                raise ValueError(f"shape {shape}: positive sizes, hidden divisible by heads")


def neox(shape: ModelShape, cfg: TrainConfig, tokenizer):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    conf = GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, intermediate_size=4 * shape.hidden,
        max_position_embeddings=cfg.context, rotary_pct=0.25, rotary_emb_base=10000,
        use_parallel_residual=True, tie_word_embeddings=False, hidden_act="gelu",
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        initializer_range=0.02)
    return GPTNeoXForCausalLM(conf)


def token_stream(texts: list[str], tokenizer) -> torch.Tensor:
    """All documents concatenated, each followed by EOS: (N,) int64."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for i in range(0, len(texts), 256):
        for doc in tokenizer(texts[i:i + 256], add_special_tokens=False)["input_ids"]:
            ids.extend(doc)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def batches(stream: torch.Tensor, seq_len: int, batch_size: int, gen: torch.Generator):
    n = stream.shape[0] - seq_len - 1
    while True:
        starts = torch.randint(0, n, (batch_size,), generator=gen)
        window = torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])
        yield window[:, :-1], window[:, 1:]  # (B, T) inputs, (B, T) labels


def _lr(base: float, elapsed: float, budget: float, step: int, warmup: int = 30) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = min(elapsed / budget, 1.0)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def _windows(stream: torch.Tensor, seq_len: int, max_windows: int):
    """(inputs, next-token labels), each (n, L): up to ``max_windows`` consecutive windows of the
    held-out stream -- one shorter window when it is shorter than ``seq_len``; (None, None) when it
    has under two tokens."""
    seq_len = min(seq_len, stream.shape[0] - 1)
    if seq_len < 1:
        return None, None
    n = min((stream.shape[0] - 1) // seq_len, max_windows)
    return stream[: n * seq_len].view(n, seq_len), stream[1: n * seq_len + 1].view(n, seq_len)


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, bf16: bool, max_windows: int = 64) -> float:
    model.eval()
    x, y = _windows(stream, seq_len, max_windows)
    if x is None:
        return float("nan")
    n = x.shape[0]
    losses = []
    for i in range(0, n, 8):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x[i:i + 8]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), y[i:i + 8].flatten()).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def top1_agreement(target, draft, stream: torch.Tensor, seq_len: int, max_windows: int = 32) -> float:
    target.eval(), draft.eval()
    x, _ = _windows(stream, seq_len, max_windows)
    if x is None:
        return float("nan")
    a = target(input_ids=x).logits.argmax(-1)
    b = draft(input_ids=x).logits.argmax(-1)
    return float((a == b).float().mean())


def train_model(model, stream, cfg: TrainConfig, minutes: float, *, teacher=None, log=print,
                label="model") -> dict:
    """Train for ``minutes`` of wall clock; returns statistics for the card."""
    gen = torch.Generator().manual_seed(cfg.seed + (1 if teacher is not None else 0))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    budget = minutes * 60
    start = time.perf_counter()
    step = tokens = 0
    ema = kl_ema = None
    for x, y in batches(stream, cfg.seq_len, cfg.batch_size, gen):
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            break
        for g in opt.param_groups:
            g["lr"] = _lr(cfg.lr, elapsed, budget, step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = model(input_ids=x).logits.float()
            loss = ce = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            if teacher is not None:
                with torch.no_grad():
                    t_logp = F.log_softmax(teacher(input_ids=x).logits.float(), -1)
                kl = F.kl_div(F.log_softmax(logits, -1), t_logp, log_target=True, reduction="batchmean") / x.shape[1]
                loss = ce + cfg.distill_weight * kl
                kl_ema = kl.item() if kl_ema is None else 0.98 * kl_ema + 0.02 * kl.item()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ema = ce.item() if ema is None else 0.98 * ema + 0.02 * ce.item()
        if step % 25 == 0:
            log(f"[{label}] step {step} {elapsed / 60:5.2f}/{minutes:.2f} min  loss {ema:.3f}"
                + (f"  kl {kl_ema:.3f}" if kl_ema is not None else ""))
    model.eval()
    out = {"steps": step, "tokens": tokens, "minutes": round((time.perf_counter() - start) / 60, 2),
           "final_loss_ema": ema}
    if kl_ema is not None:
        out["final_kl_ema"] = kl_ema
    return out


def split_heldout(docs: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(held out, training): the first documents up to ``fraction`` of the characters, the last
    of them cut where the fraction ends -- never the training text itself (with one document, or
    a few long ones, whole documents would hold out far more or far less than ``fraction``)."""
    need = max(1, int(sum(map(len, docs)) * fraction))
    held: list[str] = []
    for i, d in enumerate(docs):
        if len(d) >= need:
            rest = d[need:]
            return held + [d[:need]], ([rest] if rest.strip() else []) + docs[i + 1:]
        held.append(d)
        need -= len(d)
    return held, []


def train_pair(source: str, column: str, out_dir: str | Path, cfg: TrainConfig = TrainConfig(),
               log=print, overwrite: bool = False) -> dict:
    """Train tokenizer, target and draft on ``source[column]``; save HF directories + card.json
    into ``out_dir``, which must be new or empty unless ``overwrite`` (minutes of training would
    replace a pair -- the bundled one, say -- without a word)."""
    from .data import read_texts

    torch.manual_seed(cfg.seed)
    out = Path(out_dir)
    if not overwrite and out.is_dir() and any(out.iterdir()):
        raise ValueError(f"{out} is not empty (a trained pair?): give another --out, or --overwrite to replace it")
    texts = [t for t in read_texts(source, column) if isinstance(t, str) and t.strip()]
    if not texts:
        raise ValueError(f"no text in column {column!r} of {source}")
    random.Random(cfg.seed).shuffle(texts)
    total, kept = 0, []
    for t in texts:
        if total >= cfg.max_chars:
            break
        kept.append(t[:cfg.max_chars - total])  # the last document cut to the cap
        total += len(kept[-1])
    held, train = split_heldout(kept, cfg.heldout_fraction)
    # (one document is split, not two: "1 training document, 1 held out" read as two: the own-models trial)
    log(f"corpus: {len(kept)} document{'s' * (len(kept) != 1)} ({total / 1e6:.1f}M chars); "
        f"{sum(map(len, held)) / max(total, 1):.1%} of the characters held out to measure loss and agreement")

    t0 = time.perf_counter()
    tokenizer = train_bpe_tokenizer(train, cfg.vocab_size)
    stream, held_stream = token_stream(train, tokenizer), token_stream(held, tokenizer)
    log(f"tokenizer: {len(tokenizer)} tokens; {stream.shape[0]:,} training tokens "
        f"({time.perf_counter() - t0:.0f}s)")
    if stream.shape[0] <= cfg.seq_len + 1:
        raise ValueError(f"corpus too small: {stream.shape[0]} tokens for seq_len {cfg.seq_len}")

    target = neox(cfg.target, cfg, tokenizer)
    t_stats = train_model(target, stream, cfg, cfg.target_minutes, log=log, label="target")
    t_stats["heldout_loss"] = heldout_loss(target, held_stream, cfg.seq_len, cfg.bf16)
    t_stats["parameters"] = sum(p.numel() for p in target.parameters())

    draft = neox(cfg.draft, cfg, tokenizer)
    d_stats = train_model(draft, stream, cfg, cfg.draft_minutes, teacher=target, log=log, label="draft")
    d_stats["heldout_loss"] = heldout_loss(draft, held_stream, cfg.seq_len, cfg.bf16)
    d_stats["parameters"] = sum(p.numel() for p in draft.parameters())
    agree = top1_agreement(target, draft, held_stream, cfg.seq_len)

    for name, model in (("target", target), ("draft", draft)):
        model.to(torch.bfloat16).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        model.generation_config.save_pretrained(out / name)
        shutil.copymode(out / name / "config.json", out / name / "model.safetensors")  # (saved private: 0600)
    card = {
        "corpus": source, "column": column, "documents": len(train), "chars": total,
        "train_tokens": int(stream.shape[0]), "heldout_tokens": int(held_stream.shape[0]),
        "vocab": len(tokenizer), "config": asdict(cfg),
        "target": {**asdict(cfg.target), **t_stats},
        "draft": {**asdict(cfg.draft), **d_stats, "heldout_top1_agreement_with_target": agree},
        "weights_dtype": "bfloat16 (load as float32)",
    }
    (out / "card.json").write_text(json.dumps(card, indent=2))
    log(f"saved {out}: target held-out loss {t_stats['heldout_loss']:.3f}, draft {d_stats['heldout_loss']:.3f}, "
        f"top-1 agreement {agree:.3f}")
    return card
