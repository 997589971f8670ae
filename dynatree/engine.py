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

With ``temperature > 0`` the same loop samples: the draft proposes draws instead of its top-k,
and accept is multi-candidate rejection sampling (sampling.walk) instead of argmax matching, so
the committed tokens follow the target's (warped) sampling distribution exactly.

Host syncs per iteration (each named where it happens): draft top-k once per drafted level
(tree shape decisions), and the accepted path + bonus once after verification (greedy), or one
per tried candidate (sampling).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from .config import ARConfig, SpecConfig, make_config
from .drafting import Drafter
from .kvcache import new_cache
from .lookup import LookupStats, NgramIndex, graft
from .metrics import Metrics, Tally, Timed, finish
from .models import ModelPair
from .native import argmax_rows
from .policies import make_policy
from .sampling import Sampler, walk
from .runtime import KeyMask
from .tree import (Tree, accept_path, ancestor_matrix, child_index, flatten_bfs, long_tensor,
                   position_ids)


class ContextError(ValueError):
    """The prompt leaves no room in the models' context window."""


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str  # "length" | "eos" | "context"
    method: str
    metrics: Metrics
    options: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "method": self.method, "options": self.options, "metrics": self.metrics.as_dict()}


def _sync(device: torch.device) -> None:
    torch.cuda.synchronize(device)


@dataclass
class TreeTensors:
    tokens: torch.Tensor  # (n,) int64, BFS order
    positions: torch.Tensor | None  # (1, n) int64 prefix_len + depth; None for a chain
    mask: KeyMask | None  # prefix + ancestors; None for a chain (the causal mask)


def tree_tensors(tree: Tree, prefix_len: int, device: torch.device) -> TreeTensors:
    """The verification inputs of a flattened tree whose root sits at position ``prefix_len``.

    A chain (node i's parent is i - 1) is an ordinary multi-token cached step: causal mask,
    consecutive positions, no tree buffers."""
    tokens = long_tensor(tree.tokens, device)
    if tree.parents == list(range(-1, len(tree) - 1)):
        return TreeTensors(tokens, None, None)
    pos, anc = position_ids(tree.depths, prefix_len), ancestor_matrix(tree.parents)
    if device.type != "cpu":
        pos, anc = pos.to(device), anc.to(device)
    return TreeTensors(tokens, pos, KeyMask(prefix_len, anc))


def verify_tree(model, cache, tt: TreeTensors, greedy: bool = True):
    """One target forward over the flattened tree; returns the runner's Output: logits (1, n, V)
    and, when greedy, ``choice``, the target's argmax at every node (host sync)."""
    return model(input_ids=tt.tokens[None], attention_mask=tt.mask, position_ids=tt.positions,
                 past_key_values=cache, use_cache=True, argmax=greedy)


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
    model(input_ids=long_tensor(path_tokens, model.device)[None], past_key_values=cache, use_cache=True)
    return 1


def accept_greedy(tree: Tree, choice: list[int]) -> tuple[list[int], int]:
    """choice: the target's argmax at each node.  Returns (accepted path of nodes from the root,
    bonus token)."""
    return accept_path(tree.tokens, tree.parents, choice)


def accept_sampled(tree: Tree, new_index: dict[int, int], logits: torch.Tensor, drafter: Drafter,
                   sampler: Sampler, chain: list[int] = ()) -> tuple[list[int], int]:
    """logits: (n, V).  Multi-candidate rejection sampling; returns (path, last token).

    new_index: pre-BFS node id -> flattened index; chain: the grafted lookup chain's nodes
    (flattened indices), each tried first at its parent."""
    cands = {new_index[old]: c for old, c in drafter.cands.items() if old in new_index}
    copies = {tree.parents[v]: tree.tokens[v] for v in chain}
    return walk(sampler.probs(logits), cands, child_index(tree.tokens, tree.parents), sampler, copies)


@torch.inference_mode()
def decode(pair: ModelPair, prompt_ids: list[int], cfg=None, *, max_new_tokens: int = 128,
           ignore_eos: bool = False) -> tuple[list[int], str, Metrics]:
    """Decode one prompt with the method described by ``cfg``.

    Returns (new token ids, finish reason, metrics).  At temperature 0 the tokens equal greedy
    autoregressive decoding with the target, whatever the method; above 0 they are a sample
    from the target's distribution (reproducible with ``cfg.seed``).
    """
    cfg = cfg if cfg is not None else ARConfig()
    policy = make_policy(cfg)
    policy.attach(pair)
    if policy.needs_draft and pair.draft is None:
        raise ValueError("this method needs a draft model; the pair was loaded without one")
    if not prompt_ids:
        raise ValueError("empty prompt: at least one token is needed")
    if len(prompt_ids) >= pair.max_context:
        raise ContextError(f"prompt of {len(prompt_ids)} tokens leaves no room in the "
                           f"{pair.max_context}-token context")
    kv_update = cfg.kv_update if isinstance(cfg, SpecConfig) else "gather"
    clock = [0.0]  # seconds inside model forwards (metrics.Timed)
    target, dev = Timed(pair.runner("target"), clock), pair.device
    draft = Timed(pair.runner("draft"), clock) if policy.needs_draft else None  # built before the clock starts
    eos = None if ignore_eos else pair.eos_token_id
    n_prompt = len(prompt_ids)
    sampler = Sampler.from_config(cfg)

    def next_token(logits: torch.Tensor) -> int:
        """logits: (V,).  Host sync: the next token."""
        return argmax_rows(logits[None])[0] if sampler is None else sampler.sample(sampler.probs(logits[None])[0])

    cuda = dev.type == "cuda"  # CPU forwards are synchronous; CUDA ones are timed after a sync
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    if cuda:
        _sync(dev)
    t_start = time.perf_counter()
    budget = max(getattr(cfg, "max_nodes", 0), getattr(cfg, "budget", 0), getattr(cfg, "k", 0), 1)
    capacity = n_prompt + max_new_tokens + budget + 8
    cache = new_cache(target, capacity)
    out: list[int] = []
    finish_reason = "length"
    target_forwards = 0
    tally = Tally()
    verify_time = 0.0

    def stop_after(tok: int) -> str | None:
        out.append(tok)
        if eos is not None and tok == eos:
            return "eos"
        if len(out) >= max_new_tokens:
            return "length"
        if n_prompt + len(out) >= pair.max_context:
            return "context"
        return None

    if max_new_tokens <= 0:
        return [], "length", finish(tally, prompt_tokens=n_prompt, new_tokens=0, wall=0.0, ttft=0.0,
                                    prefill=0.0, draft_time=0.0, verify_time=0.0,
                                    target_forwards=0, draft_forwards=0, device=dev)

    # Prefill: the whole prompt; its last logits give the first token (TTFT).
    ids = torch.tensor([prompt_ids], device=dev)  # (1, n_prompt)
    logits = target(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    target_forwards += 1
    first = next_token(logits)
    ttft = time.perf_counter() - t_start
    prefill = ttft
    reason = stop_after(first)

    drafter = None
    if policy.needs_draft:
        drafter = Drafter(draft, pair.vocab, capacity, sampler)
        drafter.extend(prompt_ids)
    lookup = getattr(cfg, "lookup_length", getattr(cfg, "lookup", 0))
    index = NgramIndex(prompt_ids + out) if lookup else None
    lookup_stats = pair.state.setdefault("lookup", LookupStats()) if lookup else None

    while reason is None:
        root = out[-1]
        prefix_len = n_prompt + len(out) - 1  # tokens in the target cache; the root's position
        room = min(max_new_tokens - len(out), pair.max_context - n_prompt - len(out))
        max_depth = room - 1  # deepest useful drafted token: path + bonus must fit

        # draft
        proposal, match, hint = [], 0, ()
        if index is not None and max_depth > 0:
            proposal, match = index.propose(min(lookup, max_depth))
            hint = lookup_stats.values(match, len(proposal))
        tree = policy.draft(drafter, root, max_depth, hint) if drafter is not None else Tree.root_only(root)
        chain, fresh = graft(tree, proposal, match, lookup_stats, tree.bar) if proposal else ([], [])
        tree, order = flatten_bfs(tree)
        new_index = {old: new for new, old in enumerate(order)} if chain or sampler is not None else None
        chain = [new_index[v] for v in chain]  # flattened indices from here on

        # verify
        if cuda:
            _sync(dev)
        t0 = time.perf_counter()
        if len(tree) == 1:
            # A bare root (ar, or nothing worth drafting): an ordinary cached step; accepting
            # and committing are trivial, so skip the tree buffers entirely.
            ids = long_tensor([root], dev)[None]  # (1, 1)
            res = target(input_ids=ids, past_key_values=cache, use_cache=True, argmax=sampler is None)
            target_forwards += 1
            path_nodes, new_tokens = [0], [res.choice[0] if sampler is None else next_token(res.logits[0, -1])]
        else:
            tt = tree_tensors(tree, prefix_len, dev)
            res = verify_tree(target, cache, tt, greedy=sampler is None)
            target_forwards += 1

            # accept
            if sampler is None:
                path_nodes, last = accept_greedy(tree, res.choice)
            else:
                path_nodes, last = accept_sampled(tree, new_index, res.logits[0], drafter, sampler, chain)
            new_tokens = [tree.tokens[u] for u in path_nodes[1:]] + [last]

            # commit
            target_forwards += commit_target(target, cache, path_nodes, [tree.tokens[u] for u in path_nodes],
                                             prefix_len, kv_update)
        if cuda:
            _sync(dev)
        dt = time.perf_counter() - t0
        verify_time += dt
        policy.observe_verify(len(tree), dt)
        if drafter is not None:
            drafter.commit([order[u] for u in path_nodes], new_tokens)  # drafter knows pre-BFS ids
        accepted = len(path_nodes) - 1
        policy.observe(accepted, tree, path_nodes)
        if chain:
            lookup_stats.observe(match, chain, fresh, path_nodes)

        committed = 0
        for tok in new_tokens:
            committed += 1
            reason = stop_after(tok)
            if reason is not None:
                break
        if index is not None:
            index.extend(new_tokens[:committed])
        from_lookup = sum(1 for u in path_nodes[1:committed + 1] if u in tree.grafted) if tree.grafted else 0
        tally.add(committed, min(accepted, committed), tree.max_depth, len(tree) - 1, from_lookup)

    if cuda:
        _sync(dev)
    wall = time.perf_counter() - t_start
    finish_reason = reason
    metrics = finish(tally, prompt_tokens=n_prompt, new_tokens=len(out), wall=wall, ttft=ttft,
                     prefill=prefill, draft_time=drafter.seconds if drafter else 0.0,
                     verify_time=verify_time, target_forwards=target_forwards,
                     draft_forwards=drafter.forwards if drafter else 0, device=dev,
                     forward_time=clock[0])
    return out, finish_reason, metrics


def generate(pair: ModelPair, prompt: str | list[int], method: str = "dynatree",
             options: dict | None = None, *, max_new_tokens: int = 128,
             ignore_eos: bool = False) -> Generation:
    """Decode one prompt (text or token ids) and return tokens, text and metrics."""
    prompt_ids = pair.encode(prompt) if isinstance(prompt, str) else list(prompt)
    cfg = options if not isinstance(options, (dict, type(None))) else make_config(method, options)
    ids, reason, metrics = decode(pair, prompt_ids, cfg, max_new_tokens=max_new_tokens,
                                  ignore_eos=ignore_eos)
    return Generation(ids, pair.decode(ids), reason, method, metrics, asdict(cfg))
