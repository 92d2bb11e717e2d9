"""Serving: the request scheduler over an engine's slots, text handling (tokenizer, chat template,
stop strings) and the OpenAI-compatible HTTP server (``python -m trtllm_mk serve``)."""
