"""The bundled paged-attention replica server (paged KV cache, prefix caching, continuous batching,
multi-LoRA, OpenAI API). Only the runner module will import torch. Built in the engine issues."""
