"""Prompt datasets: generated in code (builtin:NAME) or JSONL files."""
