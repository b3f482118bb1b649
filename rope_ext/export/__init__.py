"""What rope-ext writes for other engines: a patched checkpoint from its config alone (checkpoint,
`rope-ext patch`), proved on its small twin (twin), the serve commands and model card (handoff),
and a patched GGUF file for llama.cpp (gguf_patch, with llama.cpp's rope restated in gguf_rope)."""
