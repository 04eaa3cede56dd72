"""The embedded engine: continuous batching with a KV cache on a transformers causal LM.

engine.py         HfEngine, the Engine Protocol in this process; eval_mode
decode_batch.py   DecodeBatch: rows sampled together in one KV cache, refilled as they finish
kv_cache.py       the preallocated KV cache the batch writes into in place
llama_decoder.py  LlamaDecoder: a Llama-family forward written out in plain torch
packing.py        packed weights for the CPU's GEMM, and when packing pays
prompts.py        prompts laid out for a batch: left padding, distinct prompts, shared prefix

Speed on CPU: the KV cache is preallocated, sampling draws one uniform number per row
(rollout.engines.sampling.sample_tokens), and Llama-family models (llama, mistral, qwen2) prefill
and decode through LlamaDecoder, on packed weights (oneDNN's, which serve any batch width; else
MKL's, packed per batch width); other models run their own forward. Prompts that begin alike (a
system prompt, a chat template) prefill that shared prefix once.
"""
