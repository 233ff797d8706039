"""DASH decoders: the config.json, prompts, the built-in decoder, class resolution and
checkpoints (one module each; :mod:`dash_trt.model` gathers the public names)."""
