"""kvmodels: minimal Llama, GPT-J, MPT and LCKV models on a paged, ragged, compressible KV cache."""
