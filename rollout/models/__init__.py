"""Models and tokenizers: loading them, reading GGUF files, and the builtin tiny models.

builtin.py        the builtin tiny models (model.builtin) as pure data: config.json, chat template
builtin_build.py  builds a builtin model into the cache: random weights, a trained tiny tokenizer
gguf.py           reads a GGUF file's header (metadata and tensor infos), never its tensor data
hub.py            finds a Hub model (model.hub) in the local Hugging Face cache; never downloads
cache.py          rollout's local cache (built models, dequantized GGUF weights), multi-process safe
loading.py        loads the planned model and its tokenizer in a worker (GGUF dequantized once)

builtin, gguf, hub and cache never import torch, and builtin_build imports it only to build
weights: the planner uses them and stays torch-free. loading imports torch and transformers. Nothing is
imported here, so that importing one module never pulls in another.
"""
