"""Prompt compression: cut a long prompt to what a target model needs (compressor: LLMLingua, LongLLMLingua,
Selective Context and random baselines, scored by a small causal LM)."""
