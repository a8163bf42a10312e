"""Models without downloads: a tiny causal LM and tokenizer built in code, or `from_pretrained`."""
