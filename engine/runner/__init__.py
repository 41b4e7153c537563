"""The runner: the engine's only torch code. One forward pass of a Llama-family decoder over a batch of
scheduled sequences, reading and writing a paged KV cache.

    config.py (engine/)  ModelConfig, parsed from config.json (plain Python)
    weights.py           safetensors -> model parameters, with errors naming file and tensor
    model.py             the decoder: RMSNorm, rotary embeddings, attention projections, SwiGLU MLP
    linear.py            matmul backends (oneDNN with packed weights on CPU, F.linear elsewhere)
    kv_cache.py          the paged KV cache and the reusable gather workspace
    attention.py         per-step attention metadata and paged attention over the cache
    kernels.py           the compiled CPU kernel (csrc/paged_attention.cpp): built once, cached, loaded
    lora.py              multi-LoRA: per-slot stacked adapter weights, the delta of a mixed batch
    runner.py            ModelRunner: ModelInput -> logits of the sequences that sample

Import `engine.runner.runner.ModelRunner`; this package module imports nothing, so importing one
submodule (the sampler, say) does not load the model code.
"""
