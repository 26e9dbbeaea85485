"""Quantization algorithms (rtn, gptq, awq, smoothquant, llm_int8) and the writers of their output (format, export,
gguf_export). The format they write, and the modules that run it, are leanlm.lowbit."""
