"""kvmodels: minimal Llama, GPT-J, MPT and LCKV models on a paged, ragged, compressible KV cache.

    >>> from kvmodels import generate, load_checkpoint
    >>> from kvpolicies import compose
    >>> loaded = load_checkpoint()                      # SmolLM2-135M-Instruct, converted once and cached
    >>> tok = loaded.tokenizer
    >>> ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    >>> result = generate(loaded.model, [ids], 32, compose("squeeze", "keyformer", budget=0.2))

``Decoder`` continues a batch after a generation (follow-up questions) and prefills long prompts in chunks
(``chunked_num_pages`` sizes its page pool for that).
"""

from kvmodels.decoder import Decoder, chunked_num_pages
from kvmodels.generate import CacheLayout, CausalLM, GenerationResult, generate
from kvmodels.llama import LLAMA_CONFIGS, Llama, LlamaConfig
from kvmodels.loading import CheckpointError, from_transformers, load_checkpoint, read_gguf

__all__ = [
    "LLAMA_CONFIGS", "CacheLayout", "CausalLM", "CheckpointError", "Decoder", "GenerationResult", "Llama",
    "LlamaConfig",
    "chunked_num_pages", "from_transformers", "generate", "load_checkpoint", "read_gguf",
]
