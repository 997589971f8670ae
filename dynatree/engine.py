"""The decoding loop: prefill, then draft -> verify -> accept -> commit until a stop condition.

Every method runs this loop; they differ only by drafting policy (policies.py).  ``ar`` drafts
nothing, so its tree is the root alone and each iteration is one ordinary cached target step.

State between iterations (t = committed tokens, prompt included)::

    target cache : keys/values of tokens 0 .. t-2       (P = t-1 slots)
    root         : token t-1, the last committed token   (position P)
    draft        : see drafting.Drafter

One iteration:
  draft   the policy grows a tree under the root (draft forwards only);
  verify  one target forward over the BFS-flattened tree with a tree mask and
          position ids P + depth; logits at node i predict the token after node i's path;
  accept  the longest path whose tokens equal the target's argmax at their parents, plus the
          target's argmax after that path (the bonus token);
  commit  the accepted nodes' keys/values (root included) are moved to slots P.. and the rest
          dropped; the bonus becomes the next root, so its keys/values come from the next
          verification pass: exactly one target forward per iteration.

With ``temperature > 0`` the same loop samples: every argmax above becomes the argmax of the
logits perturbed by the seeded Gumbel noise of the token index it predicts (sampling.py), for the
draft's proposals and the target's choices alike, so a sampled generation is the one ``ar``
draws with the same seed, token for token, and follows the target's (warped) distribution exactly.

Host syncs per iteration (each named where it happens): draft top-k once per drafted level
(tree shape decisions), and the target's choices once after verification -- for all rows at
once; rows sampling under top-k / top-p add one more at each, for all of their draws.
"""
from __future__ import annotations

import numbers
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace

import torch

from .config import (METHODS, ARConfig, ContextError, MethodConfig, SpecConfig, cache_rows, check_samples,
                     check_window, check_windows, draws_differ, make_config, unused_options)
from .drafting import Drafter, DraftVocabError, ForwardClock, drive
from .kvcache import new_cache
from .lookup import LookupStats, NgramIndex, graft
from .metrics import Metrics, Tally, finish
from .models import LEARNED_KEPT, ModelPair, is_chat
from .names import rope_resets, rope_switch
from .budget import Governor
from .policies import make_policy
from .prefix import prefill_shared, remember
from .sampling import Sampler, choose_each, head, in_head, sample_seed
from .stops import Stop, text_of
from .runtime import KeyMask, Seq
from .tree import Tree, accept_path, ancestor_matrix, best_chain, flatten_bfs, long_tensor, position_ids


@dataclass
class Generation:
    """One generated continuation: its new token ids and their text (cut before a stop string),
    why it ended ("length", "eos", "stop" or "context"), the method and every option it ran with
    (``options["seed"]`` reproduces a sample), and its metrics (metrics.Metrics)."""

    token_ids: list[int]
    text: str | None  # None: the pair has no tokenizer to read the ids with (pair_from_models without one)
    finish_reason: str  # "length" | "eos" | "stop" | "context"
    method: str
    metrics: Metrics
    options: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "method": self.method, "options": self.options, "metrics": self.metrics.as_dict()}


def _sync(device: torch.device) -> None:
    torch.cuda.synchronize(device)


def verify_seq(tree: Tree, prefix_len: int, cache, device: torch.device, perturb=None) -> Seq:
    """verify: a flattened tree whose root sits at position ``prefix_len``, as one sequence of the
    packed target forward: each node sees the prefix and its ancestors, at position prefix_len +
    depth.  A chain (a bare root included) is an ordinary cached step: causal mask, consecutive
    positions, no tree buffers.  ``perturb``: sampling's heads (runtime.Perturb)."""
    tokens = long_tensor(tree.tokens, device)  # (n,) BFS order
    if tree.parents == list(range(-1, len(tree) - 1)):
        return Seq(tokens, cache, perturb=perturb)
    pos, anc = position_ids(tree.depths, prefix_len)[0], ancestor_matrix(tree.parents)  # (n,), (n, n)
    if device.type != "cpu":
        pos, anc = pos.to(device), anc.to(device)
    return Seq(tokens, cache, pos, KeyMask(prefix_len, anc), perturb=perturb)


def commit_target(model, cache, path: list[int], path_tokens: list[int], prefix_len: int,
                  kv_update: str) -> int:
    """Keep the accepted path's keys/values at slots ``prefix_len..``; returns forwards run.

    path: node indices (root first, ascending); path_tokens: their tokens.
    """
    if kv_update == "gather":
        cache.keep(prefix_len, [prefix_len + u for u in path])
        return 0
    # The seed's rollback + rebuild: crop to the prefix and run the accepted tokens again.
    cache.truncate(prefix_len)
    model.forward([Seq(long_tensor(path_tokens, model.device), cache, keep=1)])
    return 1


def accept_greedy(tree: Tree, choice: list[int]) -> tuple[list[int], int]:
    """choice: the target's choice at each node (its argmax, or its perturbed argmax when
    sampling).  Returns (accepted path of nodes from the root, bonus token)."""
    return accept_path(tree.tokens, tree.parents, choice)


class _Row:
    """One sequence's decoding state inside a :class:`BatchDecoder`.

    Between iterations: ``out`` holds the committed new tokens; the target cache holds the
    prompt and every committed token but the last (the root of the next tree)."""

    def __init__(self, key, pair: ModelPair, prompt: list[int], cfg, max_new_tokens: int, ignore_eos: bool,
                 stop: Stop | None = None, again: bool = False):
        self.key, self.prompt, self.cfg, self.max_new_tokens = key, prompt, cfg, max_new_tokens
        self.policy = make_policy(cfg)
        self.policy.attach(pair)
        self.eos = () if ignore_eos else pair.eos_token_ids
        self.stop_hit = stop.watch(pair.decoder(prompt)) if stop is not None else None
        self.max_context = pair.max_context
        self.rope_switch = rope_switch(pair.target.config)
        self.rope_reset = rope_resets(pair.target.config)
        self.sampler = Sampler.from_config(cfg, prompt)
        self.kv_update = cfg.kv_update if isinstance(cfg, SpecConfig) else "gather"
        self.window = pair.window(cfg)  # StreamingLLM's cache policy, or None
        self.lookup = cfg.lookup_length
        self.lookup_stats = pair.learned(("lookup", *cfg.sampling_key), LookupStats) if self.lookup else None
        self.capacity = cache_rows(cfg, len(prompt) + max_new_tokens, pair.max_context)
        self.cache = new_cache(pair.runner("target"), self.capacity, cfg.kv_dtype)
        self.drafter: Drafter | None = None
        self.draft_has_prompt = False  # the prompt goes through the draft at the row's first drafted iteration
        self.draft_spent = (0.0, 0)  # a retired drafter's seconds and forwards
        self.index: NgramIndex | None = None
        self.out: list[int] = []
        self.reason: str | None = None
        self.tally = Tally()
        self.t_start = time.perf_counter()
        self.ttft = self.verify_time = self.prefill_time = 0.0
        self.clock0 = 0.0  # the decoder's ForwardClock when the row joined (BatchDecoder.add)
        self.cached_tokens = 0  # prompt tokens whose keys/values came from prefix caching (prefix.py)
        self.again = again  # more rows with this prompt follow (BatchDecoder.add)
        self.target_forwards = 0
        self.last_n = 1  # tokens this row put in the last target forward
        self.budgeted = getattr(self.policy, "latency", None) is not None  # under the hardware budget
        self.governed = None  # (BatchDecoder._add: the config without its seed, shared by equal ones)

    def retire_drafter(self) -> None:
        """The row holds a token its draft cannot embed (a target vocabulary wider than the
        draft's): it goes on without drafts, every iteration a root alone -- `ar`'s tokens."""
        d, self.drafter = self.drafter, None
        self.draft_spent = (d.seconds, d.forwards)
        self.budgeted = False  # nothing left to price: its iterations are not the Governor's to weigh

    def stop_after(self, tok: int) -> str | None:
        """Commit one token; the finish reason if it ends the sequence."""
        self.out.append(tok)
        if tok in self.eos:
            self.reason = "eos"
        elif self.stop_hit is not None and self.stop_hit(self.out):
            self.reason = "stop"
        elif len(self.out) >= self.max_new_tokens:
            self.reason = "length"
        elif self.window is None and len(self.prompt) + len(self.out) >= self.max_context:
            self.reason = "context"
        return self.reason

    def evict(self) -> None:
        """With a window, make room for the next root (kvcache.Window: evictions depend on the
        token count alone, the same for every method)."""
        if self.window is not None:
            self.window.make_room(self.cache, 1)

    def max_depth(self, prefix_len: int) -> int:
        """The deepest useful drafted token: path + bonus fit in max_new_tokens and the context,
        with a window every node's position stays inside it (so no tree spans an eviction), and
        no tree spans a LongRoPE switch (names.rope_switch: a forward's rows all read the table of
        its largest position, and an AR step's read its own)."""
        room = self.max_new_tokens - len(self.out)
        if self.window is None:
            depth = min(room, self.max_context - len(self.prompt) - len(self.out)) - 1
        else:
            depth = min(room - 1, self.window.size - 1 - prefix_len)
        if self.rope_switch is not None and prefix_len < self.rope_switch:  # the root at position prefix_len
            depth = min(depth, self.rope_switch - 1 - prefix_len)
        if self.resets_rope(prefix_len):
            depth = 0
        return depth

    def resets_rope(self, prefix_len: int) -> bool:
        """Whether the forward of a root at ``prefix_len`` recomputes the row's whole cache: the
        first past the LongRoPE switch of a model whose generate() does (names.ROPE_RESET), so its
        earlier keys take the long factors too, as in that model's own greedy decoding."""
        return self.rope_reset and prefix_len == self.rope_switch

    def target_seq(self, tree: Tree, prefix_len: int, dev: torch.device) -> Seq:
        """The row's part of the iteration's target forward (verify_seq), or at a LongRoPE reset
        (resets_rope; the tree is a bare root) the whole text again over the cache, emptied now."""
        perturb = head(self.sampler, tree.depths)
        if not self.resets_rope(prefix_len):
            return verify_seq(tree, prefix_len, self.cache, dev, perturb)
        self.cache.truncate(0)
        return Seq(long_tensor([*self.prompt, *self.out], dev), self.cache, keep=1, perturb=perturb)

    def metrics(self, dev: torch.device, clock: ForwardClock) -> Metrics:
        d = self.drafter
        seconds, forwards = (d.seconds, d.forwards) if d else self.draft_spent
        return finish(self.tally, prompt_tokens=len(self.prompt), new_tokens=len(self.out),
                      cached_prompt_tokens=self.cached_tokens,
                      wall=time.perf_counter() - self.t_start if self.max_new_tokens > 0 else 0.0, ttft=self.ttft,
                      prefill=self.prefill_time, draft_time=seconds, verify_time=self.verify_time,
                      target_forwards=self.target_forwards, draft_forwards=forwards, device=dev,
                      forward_time=clock.seconds - self.clock0,
                      cache_bytes=self.cache.nbytes + (d.cache.nbytes if d else 0))


class _Step:
    """One row's tree for the current iteration, from drafting to commit."""

    __slots__ = ("row", "tree", "order", "chain", "fresh", "match", "prefix_len", "commit_time")


def window_options(pair, cfg) -> str | None:
    """The options of a StreamingLLM window that takes ``cfg``'s decoding past the context -- half
    the context, its eviction at most a quarter of that ("kv_window=512", "kv_window=32
    kv_evict=8") -- where that passes the checks a windowed run makes (config.check_windows with
    ModelPair.windows: it fits the context, and the models the method runs take one); else None."""
    size = pair.window_limit(cfg)[0] // 2
    evict = min(ARConfig.kv_evict, size // 4)
    try:
        check_windows({"hint": replace(cfg, kv_window=size, kv_evict=evict)}, pair.window_limit, pair.windows)
    except ValueError:
        return None
    return f"kv_window={size}" + (f" kv_evict={evict}" if evict != ARConfig.kv_evict else "")


def _token_ids(ids, vocab: int) -> list[int]:
    """A prompt's token ids as host ints in [0, vocab); ValueError names what is wrong."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"a prompt's token ids must be a list of ints, got {type(ids).__name__}")
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):  # a numpy array or a tensor
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, numbers.Integral)
                                                 for t in ids):
        raise ValueError("a prompt's token ids must be ints (a 1-D list, array or tensor of them)")
    if not ids:
        raise ValueError("empty prompt: at least one token is needed")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
    return [int(t) for t in ids]


def _check_max_new_tokens(n) -> None:
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1:
        raise ValueError(f"max_new_tokens must be a whole number >= 1, got {n!r}")


class BatchDecoder:
    """Decodes many sequences together (rows may use different methods and options).

    Each :meth:`step` runs one iteration for every active row: every drafting level of every row
    in one packed draft forward, every row's tree (or bare root) in one packed target forward,
    then accept and commit per row.  Rows added with :meth:`add` are prefilled together at the
    next step and join; finished rows leave.  On the native kernel a row's logits do not depend
    on its neighbours (batch invariance), so each row's tokens are what it gets alone: greedy
    rows equal greedy ``ar``, sampled rows ``ar`` with the same seed.
    One sequence alone is the B = 1 case (:func:`decode`).
    """

    def __init__(self, pair: ModelPair):
        self.pair, self.dev = pair, pair.device
        self.target = pair.runner("target")
        # a target whose forward cannot verify branches (models._tree_problem) verifies each tree's
        # best chain: a plain cached step, exact as ar
        self.chains_only = bool(getattr(self.target, "tree_problem", ""))
        self.joining: list[_Row] = []
        self.active: list[_Row] = []
        self.governors: dict[tuple, Governor] = {}  # batched budget against measured batched ar (B > 1)
        self.governed: dict = {}  # each budgeted config without its seed, once (governor's key)
        self.last_governor: Governor | None = None
        self.tokens = 0  # committed tokens, all rows, since construction (throughput meters read it)
        self.clock = ForwardClock()  # seconds inside model forwards, all rows' (a row's forward_time_s)
        self.broken: str | None = None  # why no step can follow (a step that raised part-way)
        self.partial: list = []  # once broken: (key, prompt ids, committed tokens) per row in flight

    def __len__(self) -> int:
        return len(self.joining) + len(self.active)

    def governor(self, size: int, budgeted: list["_Row"]) -> Governor:
        """The Governor of a batch of ``size`` rows with these budgeted ones: one per batch size (by
        power of two: trees pay at a few rows and not at many, and a static batch shrinks as its
        rows finish) and method config (budgeted rows of several configs share one), started from
        the pair's last one of that key (Governor.carry): a run of short batches does not learn
        from scratch).  The seed is not part of the key: it changes no statistic the governor
        keeps, and a service drawing each request with a new seed would add one per request."""
        cfg = budgeted[0].governed  # (one object per config: dataclasses.replace per iteration cost
        if any(r.governed is not cfg for r in budgeted):  # ~60 us, 3% of a 4-row plain step)
            cfg = None
        key = ("governor", 1 << (size - 1).bit_length(), cfg)
        if key not in self.governors:
            self.governors[key] = self.pair.learned(key, Governor, carry=Governor.carry)
            for old in list(self.governors)[:max(0, len(self.governors) - LEARNED_KEPT)]:  # (a long-lived
                del self.governors[old]  # decoder of a service, a temperature per request: as the pair's)
        gov = self.governors[key]
        if self.last_governor is not None and self.last_governor is not gov:
            self.last_governor.pause()
        self.last_governor = gov
        return gov

    def add(self, prompt_ids: list[int], cfg=None, *, max_new_tokens: int = 128, ignore_eos: bool = False,
            stop: Stop | None = None, key=None, again: bool = False) -> None:
        """Queue a prompt (token ids); ``key`` names it in :meth:`step`'s results; ``stop``: stop
        strings and token ids (stops.py); ``again``: more rows with this prompt will follow (a
        job's samples), so prefix caching keeps it from its first prefill, not its second.
        Holds the pair's lock, as :meth:`step` does: building a row may run forwards (the budget's
        first profile) on runners another thread is decoding with, and a row added during a step
        was lost or joined unprefilled."""
        with self.pair.lock:
            self._check_whole()
            self._add(prompt_ids, cfg, max_new_tokens, ignore_eos, stop, key, again)

    def _add(self, prompt_ids, cfg, max_new_tokens, ignore_eos, stop, key, again) -> None:
        cfg = cfg if cfg is not None else ARConfig()
        if not isinstance(cfg, tuple(METHODS.values())):
            raise ValueError(f"cfg must be a method's config (make_config(method, options)), got {type(cfg).__name__}")
        if make_policy(cfg).needs_draft and self.pair.draft is None:
            raise ValueError("this method needs a draft model; the pair was loaded without one "
                             "(load_pair(target, draft); on the command line --draft with --target, or --method ar "
                             "with a target alone)")
        problem = self.pair.method_problem(cfg)
        if problem:
            raise ValueError(problem)
        check_window(cfg, *self.pair.window_limit(cfg))
        prompt_ids = self._prompt(prompt_ids, cfg)  # checked here: a bad row must not break the batch
        _check_max_new_tokens(max_new_tokens)
        if not isinstance(ignore_eos, bool):  # ("no" is truthy: it would ignore EOS)
            raise ValueError(f"ignore_eos must be True or False, got {ignore_eos!r}")
        if key is not None and any(r.key == key for r in (*self.joining, *self.active)):
            raise ValueError(f"key {key!r} names a row still decoding: results would be told apart by key")
        stop = Stop.of(stop)
        if stop is not None:
            stop.check_vocab(self.pair.id_limit)
        if stop is not None and stop.strings and self.pair.tokenizer is None:
            raise ValueError("stop strings need a tokenizer to read the text; this pair has none (use stop token ids)")
        row = _Row(key, self.pair, prompt_ids, cfg, max_new_tokens, ignore_eos, stop, again)
        if row.budgeted:
            row.governed = self.governed.setdefault(unseeded := replace(cfg, seed=0), unseeded)
            if len(self.governed) > LEARNED_KEPT:  # (the oldest config: rows of it still hold their own)
                del self.governed[next(iter(self.governed))]
        row.clock0 = self.clock.seconds
        self.joining.append(row)

    def cancel(self, key) -> list[int] | None:
        """Stop decoding the row named ``key`` (a service's client went away) and return the tokens it
        had committed -- each ar's, as its result's would have begun -- or None when no row in flight
        has that key (it finished, or never was).  Between steps every row is whole, and rows keep
        their own caches, so the others decode on unchanged.  Holds the pair's lock, as step does."""
        if key is None:  # (several rows may have none: which one is meant?)
            raise ValueError("cancel takes the key a row was added with; a row added without one cannot be named")
        with self.pair.lock:
            for rows in (self.joining, self.active):
                for i, r in enumerate(rows):
                    if r.key == key:
                        del rows[i]
                        return list(r.out)
        return None

    def _window_hint(self, cfg) -> str:
        """What to do about a prompt that fills the context: shorten it, or decode with a cache window."""
        options = window_options(self.pair, cfg)
        return "shorten it" + (f", or decode with a cache window: option{'s' * (' ' in options)} {options}"
                               if options else "")

    def _prompt(self, prompt_ids, cfg) -> list[int]:
        """The prompt's ids, checked; an error about the prompt itself (not the config or the pair,
        which every prompt shares) is marked ``prompt_problem``, so decode_batch names the prompt."""
        try:
            prompt_ids = _token_ids(prompt_ids, self.pair.id_limit)
            if not getattr(cfg, "kv_window", 0) and len(prompt_ids) >= self.pair.max_context:
                raise ContextError(f"prompt of {len(prompt_ids)} tokens leaves no room in "
                                   f"{self.pair.context_said} ({self._window_hint(cfg)})")
        except ValueError as e:
            e.prompt_problem = True
            raise
        return prompt_ids

    @torch.inference_mode()
    def step(self) -> list[tuple[object, list[int], str, Metrics]]:
        """One iteration for every row (prefilling the ones that joined); returns the rows that
        finished, as (key, new token ids, finish reason, metrics).  Holds the pair's lock (other
        threads decoding with the pair wait for the step).  A step that raises (Ctrl-C, out of
        memory) may leave rows part-way through an iteration -- a draft's fed tokens consumed, a
        cache half committed -- so the decoder then refuses to go on, naming its rows in flight:
        add them to a new one (the pair is unharmed).  Before, the next step failed inside the
        drafter ("both buffer length (0) and count (-1) must not be 0")."""
        with self.pair.lock:
            self._check_whole()
            try:
                return self._step()
            except BaseException as e:
                keys = [r.key for r in self.joining + self.active]
                # the tokens each row committed (each one ar's: a greedy row re-added as its prompt plus
                # these decodes on as it would have; the service trial found them unreachable)
                self.partial = [(r.key, list(r.prompt), list(r.out)) for r in self.joining + self.active]
                self.broken = (f"this BatchDecoder's step raised {type(e).__name__}{': ' + str(e) if str(e) else ''}, "
                               f"part-way through an iteration of its rows, so it cannot go on: add the {len(keys)} "
                               f"row(s) in flight (keys {keys[:8]}{' ...' if len(keys) > 8 else ''}) to a new "
                               "BatchDecoder, where they start from their prompts (each row's key, prompt and "
                               "committed tokens are in this one's .partial); the pair is unharmed")
                raise

    def _check_whole(self) -> None:
        if self.broken:
            raise RuntimeError(self.broken)

    def _step(self) -> list[tuple[object, list[int], str, Metrics]]:
        if self.joining:
            self._prefill(self.joining)
            self.active += self.joining
            self.joining = []
        live = [r for r in self.active if r.reason is None]
        if live:
            self._iterate(live)
        done = [r for r in self.active if r.reason is not None]
        self.active = [r for r in self.active if r.reason is None]
        return [(r.key, r.out, r.reason, r.metrics(self.dev, self.clock)) for r in done]

    def _prefill(self, rows: list[_Row]) -> None:
        """Every joining prompt in one packed forward; its last logits give the first token (TTFT).
        With a window, a prompt longer than the window is fed in pieces that fill it, evicting
        between them."""
        for r in rows:
            if r.max_new_tokens <= 0:
                r.reason = "length"
        rows = [r for r in rows if r.reason is None]
        if not rows:
            return
        t0 = time.perf_counter()
        fed, copied = self._prefixes(rows, "target")
        outs = [None] * len(rows)
        for r, n in zip(rows, copied):
            r.cached_tokens = n
            if r.sampler is not None:
                r.sampler.at(0)  # the prefill draws generated index 0
        while todo := [i for i, r in enumerate(rows) if fed[i] < len(r.prompt)]:
            seqs = []
            for i in todo:
                r = rows[i]
                end = len(r.prompt) if r.window is None else min(len(r.prompt), fed[i] + r.window.size - r.cache.length)
                seqs.append(Seq(torch.tensor(r.prompt[fed[i]:end], device=self.dev), r.cache, keep=1,
                                perturb=head(r.sampler, [0])))
                fed[i] = end
            for i, o in zip(todo, self.target.forward(seqs, argmax=True)):
                outs[i] = o
                rows[i].target_forwards += 1
                rows[i].evict()
        _draw_masked(rows, outs, [[0]] * len(rows))
        self._prefixes(rows, "target", after=True)
        dt = time.perf_counter() - t0
        self.clock.seconds += dt
        for r, o in zip(rows, outs):
            r.prefill_time = dt
            r.stop_after(o.choice[-1])
            self.tokens += 1
            r.ttft = time.perf_counter() - r.t_start
            if r.policy.needs_draft and r.reason is None:
                window = self.pair.window(r.cfg, "draft")
                positions = 0 if window is not None else self.pair.draft_positions
                # (a draft that restarts within its positions never holds more than they and a tree)
                slots = cache_rows(r.cfg, len(r.prompt) + r.max_new_tokens, positions) if positions else r.capacity
                r.drafter = Drafter(self.pair.runner("draft"), self.pair.vocab, slots, r.sampler, window,
                                    r.cfg.kv_dtype, r.cfg.draft_context, positions)
                try:
                    r.drafter.extend(r.prompt + r.out)  # pending ends with the first tree's root
                except DraftVocabError:
                    r.retire_drafter()
            r.index = NgramIndex(r.prompt + r.out) if r.lookup else None

    def _draft_prefill(self, rows: list[_Row]) -> None:
        """The prompts through these rows' drafts, before each row's first drafted iteration: not at
        join, so a row the Governor keeps on bare roots throughout never pays it (it had cost a
        tree-less batched ``dynatree`` row ~1.6% of ``ar``'s time), and not in the iteration's time
        (a prompt's prefill is no cost of the iteration the Governor weighs).  Feeds what the join
        fed -- the prompt, leaving its first token queued -- and tokens committed since join stay
        queued for the catch-up (_catch_up), as after any plain stretch; a row whose draft would
        restart on those alone (more than its draft_context of them) skips the prompt."""
        fresh, later = [], []
        for r in rows:
            d = r.drafter
            r.draft_has_prompt = True
            tokens = d.pending[len(r.prompt) + 1:]
            if d.would_restart(len(r.prompt), len(tokens) + 1):  # (the catch-up's, once the prompt is in)
                continue  # (the catch-up restarts on the latest tokens: the prompt's keys would go unread)
            fresh.append(r)
            later.append(tokens)
            d.pending = d.pending[:len(r.prompt) + 1]
        if not fresh:
            return
        t0 = time.perf_counter()
        held_by = self._prefixes(fresh, "draft")[0]  # (a forward of the stored blocks' draft keys: on the clock)
        self.clock.seconds += time.perf_counter() - t0
        for r, held in zip(fresh, held_by):
            r.drafter.skip(held)  # what prefix caching gave needs no feeding
        drive([(r.drafter, r.drafter.prefill()) for r in fresh], self.clock)
        self._prefixes(fresh, "draft", after=True)
        for r, tokens in zip(fresh, later):
            r.drafter.pending += tokens

    def _prefixes(self, rows: list[_Row], which: str, after: bool = False) -> tuple[list[int], list[int]]:
        """Prefix caching (prefix.py) for ``which`` model's caches of these rows' prompts, before their
        prefill (returns the prompt tokens each cache holds from it, and of those the ones copied
        from the store) or ``after`` it (stores the prefixes now seen twice).  Rows with a cache
        window take no part (their caches evict), nor rows with the option off, nor prompts past
        a LongRoPE switch (names.rope_switch)."""
        held, copied = [0] * len(rows), [0] * len(rows)
        groups: dict[str, list[int]] = {}
        model = getattr(self.pair, which)
        switch = rope_switch(model.config) if model is not None else None
        for i, r in enumerate(rows):
            # (a draft that reads only the prompt's end cannot share its beginning; a prompt past a
            # LongRoPE switch is one forward of long factors, which pieces of it would not be)
            if (r.window is None and r.cfg.prefix_cache and (which == "target" or not _bounded(r))
                    and (switch is None or len(r.prompt) <= switch)):
                groups.setdefault(r.cfg.kv_dtype, []).append(i)
        for kv_dtype, idx in groups.items():
            store = self.pair.prefix_store(which, kv_dtype)
            items = [(rows[i].cache if which == "target" else rows[i].drafter.cache, rows[i].prompt) for i in idx]
            if after:
                remember(store, items, [rows[i].again for i in idx])
                continue
            runner = self.pair.runner(which)
            for i, h, c in zip(idx, *prefill_shared(store, runner, items, lazy=getattr(runner, "native", False))):
                held[i], copied[i] = h, c
        return held, copied

    def _iterate(self, rows: list[_Row]) -> None:
        budgeted = [r for r in rows if r.budgeted]
        governor = self.governor(len(rows), budgeted) if len(rows) > 1 and budgeted else None
        probe = governor is not None and governor.skip_drafting(len(rows))
        fresh = [r for r in rows if r.drafter is not None and not r.draft_has_prompt and not (probe and r.budgeted)]
        if fresh:
            self._draft_prefill(fresh)
        t_iter = time.perf_counter()  # (the Governor charges the catch-up to the drafted iteration)
        if not probe:
            _catch_up(rows, self.clock)
        steps, t_drive = self._draft(rows, governor, probe)
        cuda = self.dev.type == "cuda"  # CPU forwards are synchronous; CUDA ones are timed after a sync
        if cuda:
            _sync(self.dev)
        t0 = time.perf_counter()
        reset = any(s.row.resets_rope(s.prefix_len) for s in steps)  # a forward of some row's whole text
        seqs = [s.row.target_seq(s.tree, s.prefix_len, self.dev) for s in steps]
        outs = self.target.forward(seqs, argmax=True)
        _draw_masked([s.row for s in steps], outs, [s.tree.depths for s in steps])
        t_forward = time.perf_counter() - t0
        self.clock.seconds += t_forward
        n_total = sum(len(s.ids) for s in seqs)
        committed = sum(self._accept_commit(s, out) for s, out in zip(steps, outs))
        t1 = time.perf_counter()
        if cuda:
            _sync(self.dev)  # one wait for every row's cache gathers, shared out below (the draft
            # caches' gathers, queued after each row's commit, fall in it too: small beside the target's)
        wait = (time.perf_counter() - t1) / len(steps)
        for s in steps:
            dt = t_forward + s.commit_time + wait  # what verifying this row cost: the forward and its commit
            s.row.target_forwards += 1
            s.row.verify_time += dt
            if not reset:  # (an outlier the budget's and the Governor's timings leave out)
                s.row.policy.observe_verify(n_total, dt, s.prefix_len)
        self.tokens += committed
        if budgeted and not reset and not probe:  # the rest of a drafted iteration: the budget's overhead
            rest = time.perf_counter() - t_iter - t_drive - t_forward - sum(s.commit_time + wait for s in steps)
            for policy in {id(r.policy.latency): r.policy for r in budgeted}.values():  # (one per shared model)
                policy.observe_overhead(rest)
        if governor is not None and not reset:
            governor.observe(committed, (time.perf_counter() - t_iter) * 1e3, probe)

    def _draft(self, rows: list[_Row], governor: Governor | None, probe: bool = False) -> tuple[list[_Step], float]:
        """draft: every row's policy grows its tree; drafting rows share packed draft forwards.
        In a probe (budget.Governor) the rows under the hardware budget draft nothing (bare
        roots).  Returns the steps and the seconds in the draft levels (drafting.drive)."""
        steps, jobs = [], []
        total = sum(r.last_n for r in rows)  # the previous iteration's packed target forward
        for r in rows:
            s = _Step()
            s.row, s.prefix_len = r, r.cache.length  # tokens in the target cache; the root's position
            if r.sampler is not None:
                r.sampler.at(len(r.out))  # the root's next token is this generated index
            # what the budget prices its nodes against: the batch's other tokens, and this cache
            batch = (total - r.last_n, len(rows), governor.scale if governor else 1.0, s.prefix_len)
            max_depth = r.max_depth(s.prefix_len)
            s.chain, s.match, hint = [], 0, ()
            skip = probe and r.budgeted
            if r.index is not None and max_depth > 0 and not skip:
                s.chain, s.match = r.index.propose(min(r.lookup, max_depth))
                hint = r.lookup_stats.values(s.match, len(s.chain))
            if r.drafter is not None and not skip:
                jobs.append((r.drafter, r.policy.grow(r.drafter, r.out[-1], r.drafter.depth_room(max_depth), hint,
                                                      batch)))
            steps.append(s)
        t_drive = time.perf_counter()
        trees = iter(drive(jobs, self.clock))
        t_drive = time.perf_counter() - t_drive
        for s in steps:
            r = s.row
            tree = next(trees) if r.drafter is not None and not (probe and r.budgeted) else Tree.root_only(r.out[-1])
            proposal = s.chain
            s.chain, s.fresh = graft(tree, proposal, s.match, r.lookup_stats, tree.bar) if proposal else ([], [])
            if self.chains_only and len(tree) > 1:
                tree.keep = best_chain(tree)
            s.tree, s.order = flatten_bfs(tree)
            if s.chain:
                new_index = {old: new for new, old in enumerate(s.order)}
                # flattened indices from here on; a chain kept alone (chains_only) keeps a prefix of it
                s.chain = [new_index[v] for v in s.chain if v in new_index]
        return steps, t_drive

    def _accept_commit(self, s: _Step, out) -> int:
        """accept, then commit; the row's bookkeeping and stop checks.  Returns tokens committed."""
        t0 = time.perf_counter()
        r, tree = s.row, s.tree
        r.last_n = len(tree)
        if len(tree) == 1:
            path_nodes, new_tokens = [0], [out.choice[-1]]
        else:
            path_nodes, last = accept_greedy(tree, out.choice)
            new_tokens = [tree.tokens[u] for u in path_nodes[1:]] + [last]
            t_commit = time.perf_counter()
            rebuilt = commit_target(self.target, r.cache, path_nodes, [tree.tokens[u] for u in path_nodes],
                                    s.prefix_len, r.kv_update)
            r.target_forwards += rebuilt
            if rebuilt:  # (kv_update=recompute: a forward of the accepted path, the decoder's time too)
                self.clock.seconds += time.perf_counter() - t_commit
        r.evict()
        s.commit_time = time.perf_counter() - t0  # (on CUDA the gathers may still run: _iterate waits)
        if r.drafter is not None:
            try:
                r.drafter.commit([s.order[u] for u in path_nodes], new_tokens)  # drafter knows pre-BFS ids
            except DraftVocabError:
                r.retire_drafter()
        accepted = len(path_nodes) - 1
        r.policy.observe(accepted, tree, path_nodes)
        if s.chain:
            r.lookup_stats.observe(s.match, s.chain, s.fresh, path_nodes)
        committed = 0
        for tok in new_tokens:
            committed += 1
            if r.stop_after(tok) is not None:
                break
        if r.index is not None:
            r.index.extend(new_tokens[:committed])
        from_lookup = sum(1 for u in path_nodes[1:committed + 1] if u in tree.grafted) if tree.grafted else 0
        r.tally.add(committed, min(accepted, committed), tree.max_depth, len(tree) - 1, from_lookup)
        return committed


def _bounded(r: _Row) -> bool:
    """Whether the row's draft reads less than its whole prompt (SpecConfig.draft_context, or a
    prompt its positions cannot hold with room for trees: Drafter.positions)."""
    return r.drafter.would_restart(0, len(r.prompt) + 1)


def _catch_up(rows: list[_Row], clock: ForwardClock) -> None:
    """Before a drafted iteration: drafts that sat out iterations (budget.Governor's plain ones)
    are fed the tokens committed meanwhile, and lookup indexes take them in.  It is timed with the
    iteration: switching between plain and drafted segments costs this, and the Governor's
    segments (8 iterations) amortise it -- judged alone, after a gap of 64 iterations the catch-up
    made a drafted iteration cost 4x a plain one (16 rows), so trees could never win an
    exploration back; left out altogether, trees that lost 12% looked like a tie (B = 4).  After
    a long gap (up to 256 iterations) a draft restarts on its last draft_context tokens instead
    (Drafter.prefill).  A row whose prompt has not gone through its draft is not caught up: that
    is a prefill (_draft_prefill), not this iteration's cost."""
    late = [r.drafter for r in rows if r.drafter is not None and r.draft_has_prompt and len(r.drafter.pending) > 2]
    if late:
        drive([(d, d.prefill()) for d in late], clock)
    for r in rows:
        if r.index is not None:
            r.index.catch_up()


def _draw_masked(rows: list[_Row], outs: list, depths: list[list[int]]) -> None:
    """Rows sampled under top-k / top-p draw from their masked, perturbed scores, not from the
    argmax head fused into the forward: all their draws in one host sync (sampling.choose_each),
    put where the head's argmax goes (Output.choice), so accept reads every row alike."""
    todo = [(r, o, d) for r, o, d in zip(rows, outs, depths) if not in_head(r.sampler)]
    if todo:
        draws = choose_each([r.sampler for r, _, _ in todo], [o.logits[0] for _, o, _ in todo],
                            [d for _, _, d in todo])
        for (_, o, _), choice in zip(todo, draws):
            o.choice = choice


def decode_batch(pair: ModelPair, prompts: list[list[int]], cfg=None, *, max_new_tokens: int = 128,
                 ignore_eos: bool = False, stop: Stop | None = None,
                 per_prompt: int = 1) -> list[tuple[list[int], str, Metrics]]:
    """Decode several prompts together (one BatchDecoder); returns (new token ids, finish reason,
    metrics) per prompt, in order.  ``cfg`` is one config for all or a list with one per prompt.
    ``per_prompt``: consecutive entries that are draws of one prompt (how an error names it)."""
    cfgs = cfg if isinstance(cfg, (list, tuple)) else [cfg] * len(prompts)
    if len(cfgs) != len(prompts):
        raise ValueError(f"{len(cfgs)} configs for {len(prompts)} prompts: give one, or one per prompt")
    dec = BatchDecoder(pair)
    for i, (p, c) in enumerate(zip(prompts, cfgs)):
        try:
            dec.add(p, c, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=stop, key=i)
        except ValueError as e:  # a prompt's own problem: which prompt, of several
            n = len(prompts) // per_prompt
            if getattr(e, "prompt_problem", False) and n > 1:
                e.args = (f"{prompt_name(i // per_prompt, n)}: {e}",)
            raise
    results: dict = {}
    while dec:
        for key, toks, reason, m in dec.step():
            results[key] = (toks, reason, m)
    return [results[i] for i in range(len(prompts))]


def prompt_name(i: int, n: int) -> str:
    """How an error names prompt i of n (just "prompt" when it is the only one)."""
    return "prompt" if n <= 1 else f"prompt {i} (of 0..{n - 1})"


def _named(read, i: int, n: int):
    """``read()``, a ValueError it raises naming prompt i of n (a bad conversation among several
    failed the call without saying which), its type kept (PairError, ContextError)."""
    try:
        return read()
    except ValueError as e:
        if n > 1 and e.args and isinstance(e.args[0], str):
            e.args = (f"{prompt_name(i, n)}: {e.args[0]}", *e.args[1:])
        raise


def decode(pair: ModelPair, prompt_ids: list[int], cfg=None, *, max_new_tokens: int = 128,
           ignore_eos: bool = False, stop: Stop | None = None) -> tuple[list[int], str, Metrics]:
    """Decode one prompt with the method described by ``cfg`` (the B = 1 case of BatchDecoder).

    Returns (new token ids, finish reason, metrics).  At temperature 0 the tokens equal greedy
    autoregressive decoding with the target, whatever the method; above 0 they are a sample
    from the target's distribution (reproducible with ``cfg.seed``).
    """
    return decode_batch(pair, [prompt_ids], cfg, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=stop)[0]


def _draws_of(cfg, prompts: int, samples: int) -> list:
    """One config per draw (``samples`` per prompt, a prompt's together).  Sampling, each draw has
    its own seed (sampling.sample_seed: the first the config's): draws of distinct prompts that
    shared a seed shared their noise, and similar prompts came out nearly the same text."""
    n = check_samples(cfg, samples) * prompts
    if not draws_differ(cfg):  # greedy: a seed changes nothing
        return [cfg] * n
    return [replace(cfg, seed=sample_seed(cfg.seed, k)) for k in range(n)]


def generate(pair: ModelPair, prompt: str | list[int] | list[dict], method: str = "dynatree",
             options: dict | MethodConfig | None = None, *, max_new_tokens: int = 128, ignore_eos: bool = False,
             stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None) -> Generation:
    """Decode one prompt (text, token ids, chat messages or one message) and return a Generation:
    ``token_ids``, ``text``, ``finish_reason`` ("eos", "stop", "length", or "context" where the
    model's context ends first) and ``metrics``.

    ``method``: one of METHODS (``ar``, ``linear``, ``fixed_tree``, ``dynatree``, ``dyspec``);
    greedy outputs equal ``ar``'s token for token, sampled ones (``temperature > 0``) ``ar``'s with
    the same ``seed``.  ``options``: the method's options (``dynatree.options_help()`` lists them
    with their defaults), or a config from ``make_config``.  ``ignore_eos``: decode past EOS.
    ``stop`` / ``stop_token_ids``: as in :func:`generate_batch` -- the text ends before a stop
    string, while ``token_ids`` keep the token that completed it.  Raises ValueError for a bad
    argument, ContextError for a prompt the context cannot hold.  The first call on a machine
    compiles the native kernel and profiles the hardware (seconds; ``dynatree build`` does the
    former ahead)."""
    if isinstance(prompt, dict):  # one message: a conversation of one (as a job's cell and the CLI read it)
        prompt = [prompt]
    return generate_batch(pair, [prompt], method, options, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                          stop=stop, stop_token_ids=stop_token_ids)[0]


def _callers_level() -> int:
    """A warning's stacklevel that names the first line outside this module -- the user's, whether
    they called generate or generate_batch (trial AG: generate's warnings named engine.py)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def prompt_token_ids(pair: ModelPair, prompt: str | list[int] | list[dict]) -> list[int]:
    """A prompt as generate_batch reads it: text, chat messages (the chat template), or token ids."""
    if isinstance(prompt, str):
        return pair.encode(prompt)
    if is_chat(prompt) or isinstance(prompt, dict):  # (a dict: one message)
        return pair.encode_chat(prompt)
    return prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)


def generate_batch(pair: ModelPair, prompts: list[str | list[int] | list[dict]], method: str = "dynatree",
                   options: dict | MethodConfig | None = None, *, max_new_tokens: int = 128, ignore_eos: bool = False,
                   stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                   samples: int = 1) -> list[Generation]:
    """Decode several prompts together, many sequences per forward (BatchDecoder); one Generation
    per prompt, in order.  A prompt is a text, token ids, or chat messages ([{"role", "content"}],
    rendered with the tokenizer's chat template, the assistant's turn opened).  ``stop``: a string or strings whose
    appearance in the generated text ends it (the text ends before it); ``stop_token_ids``:
    tokens that end it like EOS (stops.py).  ``samples``: draws per prompt (sampling only);
    ``samples`` Generations per prompt, a prompt's together, computing the prompt once (prefix
    caching).  Sampling, every draw has its own seed, the first the config's (each Generation's
    ``options["seed"]`` reproduces it alone): a prompt's draw depends on its place in the list.
    Each Generation's ``metrics.tokens_per_s`` is its own row's (its tokens over its time, which
    shares every forward): the batch's rate is the tokens of all over the call's time."""
    if not isinstance(pair, ModelPair):
        raise TypeError(f"pair must be a ModelPair from load_pair(target, draft), got {type(pair).__name__}")
    if isinstance(prompts, (str, bytes)):
        raise ValueError("generate_batch takes a list of prompts; for one, use generate (or pass [prompt])")
    if is_chat(prompts) or isinstance(prompts, dict):
        raise ValueError("generate_batch takes a list of prompts, and this is one conversation (messages): pass "
                         "[messages], or use generate")
    prompts = list(prompts)  # (a generator is read once)
    if any(isinstance(p, bytes) for p in prompts):
        raise ValueError("a prompt is bytes: pass text (str), token ids or chat messages")
    blank = [i for i, p in enumerate(prompts) if isinstance(p, str) and not p.strip()]
    if blank:
        raise ValueError(f"{prompt_name(blank[0], len(prompts))} is empty or only whitespace")  # as `dynatree run` treats it
    _check_max_new_tokens(max_new_tokens)
    bad = [type(p).__name__ for p in prompts if not isinstance(p, (str, list, tuple, dict)) and not hasattr(p, "tolist")]
    if bad:
        raise ValueError(f"a prompt is a text, token ids or chat messages, got {bad[0]}")
    rule = Stop.of(stop, stop_token_ids)
    ids = [_named(lambda: prompt_token_ids(pair, p), i, len(prompts)) for i, p in enumerate(prompts)]
    cfg = options if not isinstance(options, (dict, type(None))) else make_config(method, options)
    if type(cfg) not in METHODS.values():
        raise ValueError(f"options must be a dict of the method's options (e.g. {{'temperature': 0.7}}) or a config "
                         f"from make_config(method, ...), got {type(cfg).__name__}")
    if type(cfg) is not METHODS.get(method):
        raise ValueError(f"options is a {type(cfg).__name__}, not the config of method {method!r}")
    if note := unused_options(cfg):
        warnings.warn(note, stacklevel=_callers_level())
    cfgs = _draws_of(cfg, len(ids), samples)
    ids = [p for p in ids for _ in range(int(samples))]
    got = decode_batch(pair, ids, cfgs, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, stop=rule,
                       per_prompt=int(samples))
    return [Generation(toks, text_of(pair.decoder(p), toks, reason, rule) if pair.tokenizer is not None else None,
                       reason, method, metrics, asdict(c))
            for p, c, (toks, reason, metrics) in zip(ids, cfgs, got)]
