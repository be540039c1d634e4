"""Scheduler side: a full-attention KV-cache manager that returns the blocks prompt compression emptied.

vLLM's manager holds, per request, the blocks for ``num_tokens`` token slots, ``cdiv(num_tokens, block_size)``
of them, in logical order (block ``i`` holds slots ``[i * bs, (i + 1) * bs)``). Once a request's prompt of
``L`` tokens has been processed, the workers have moved the ``kept`` tokens each layer keeps to slots
``[0, kept)`` (:mod:`kvpolicies.vllm.backend`), so the request needs ``d = L - kept`` fewer slots from then
on: this manager frees its blocks past ``cdiv(c - d, bs)`` (``c``: the tokens processed, ``L`` unless a
preempted request recomputes its output too) and sizes every later allocation for ``num_tokens - d`` slots.
Freed blocks go back to the block pool at once, so they serve other requests from the next step on.

With decode-time eviction (``streaming``, ``window``, ``knorm``) ``d`` grows while decoding: ``d(c) = c -
stored(c)`` (:class:`kvpolicies.vllm.config.KeptLengths`), recomputed at every scheduling of the request, so
the blocks an eviction emptied in the previous step go back to the pool too.

Both sides derive ``d(c)`` from the request's policy (the server's, or its own from ``SamplingParams``'
``extra_args["kvpolicies"]``: :func:`kvpolicies.vllm.config.request_policy`), its prompt length and the
tokens processed alone (:func:`kvpolicies.vllm.config.kept_lengths`), and the workers cut their block
table to its first ``cdiv(c - d(c), bs)`` blocks in the step that empties blocks (``vllm.backend``), before
any block allocated after it is appended, so both sides hold the same blocks of every request without a
message between them.
"""

from __future__ import annotations

from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from .config import kept_lengths, policy_from_env, request_policy

#: Each scheduled request's policy (None: its cache is kept whole), set when the scheduler allocates its
#: slots (:func:`install` wraps ``KVCacheManager.allocate_slots``, which sees the request) and dropped when
#: its blocks are freed (finished or preempted; a preempted request is set again when it is rescheduled).
POLICIES: dict[str, Any] = {}


class CompressingManager(FullAttentionManager):
    """:class:`FullAttentionManager` whose requests hold ``num_tokens - dropped`` slots once their prompt is
    compressed (``dropped``: the tokens every layer evicted, from the prompt and, with decode-time eviction,
    while decoding: ``KeptLengths.dropped`` of the tokens processed, updated at every scheduling)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.enable_caching:
            raise ValueError("kvpolicies vLLM plugin: prefix caching shares blocks that compression "
                             "rewrites; start vLLM with enable_prefix_caching=False "
                             "(--no-enable-prefix-caching)")
        self.policy = policy_from_env()
        self.dropped: dict[str, int] = {}  # request id -> tokens evicted from every layer

    def _slots(self, request_id: str, num_tokens: int) -> int:
        return num_tokens - self.dropped.get(request_id, 0)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)
        if (self.policy is None or num_prompt_tokens is None
                or processed_computed_tokens < num_prompt_tokens):
            return
        policy = POLICIES.get(request_id, self.policy)
        if policy is None:
            return
        c = processed_computed_tokens
        lengths = kept_lengths(policy, num_prompt_tokens)
        if lengths.kept == num_prompt_tokens and lengths.budget <= 0:
            return  # nothing is ever evicted
        self.dropped[request_id] = dropped = lengths.dropped(c)
        blocks = self.req_to_blocks.get(request_id)
        if not blocks or dropped == 0:
            return
        keep = cdiv(c - dropped, self.block_size)
        if len(blocks) > keep:
            freed = blocks[keep:]
            del blocks[keep:]
            self.block_pool.free_blocks(reversed(freed))

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        rest = list(args)
        if request_id in self.dropped:
            if len(rest) >= 4:  # num_tokens_main_model
                rest[3] = self._slots(request_id, rest[3])
            if "num_tokens_main_model" in kwargs:
                kwargs["num_tokens_main_model"] = self._slots(request_id, kwargs["num_tokens_main_model"])
        return super().get_num_blocks_to_allocate(request_id, self._slots(request_id, num_tokens), *rest,
                                                  **kwargs)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> list:
        return super().allocate_new_blocks(request_id, self._slots(request_id, num_tokens),
                                           self._slots(request_id, num_tokens_main_model))

    def pop_blocks_for_free(self, request_id: str) -> list:
        self.dropped.pop(request_id, None)  # finished or preempted: a resumed request starts over
        POLICIES.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)


def install() -> None:
    """Make :class:`CompressingManager` the manager of full-attention KV-cache groups: vLLM's spec registry
    refuses a second manager for ``FullAttentionSpec`` (and the engine registers the built-in ones again at
    start-up), so its lookup is wrapped instead, swapping the built-in class for this subclass."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    lookup = KVCacheSpecRegistry.get_manager_class
    if getattr(lookup, "_kvpolicies", False):
        return
    allocate = KVCacheManager.allocate_slots
    default = policy_from_env()

    def allocate_slots(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        POLICIES[request.request_id] = request_policy(request.sampling_params, default)
        return allocate(self, request, *args, **kwargs)

    KVCacheManager.allocate_slots = allocate_slots  # type: ignore[method-assign]

    def get_manager_class(kvcache_spec: Any, role: str | None = None) -> Any:
        found = lookup(kvcache_spec, role)
        return CompressingManager if found is FullAttentionManager else found

    get_manager_class._kvpolicies = True  # type: ignore[attr-defined]
    KVCacheSpecRegistry.get_manager_class = staticmethod(get_manager_class)  # type: ignore[method-assign]
