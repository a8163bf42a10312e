"""Agentic episodes: tool calls parsed from generated text and tools that run them (sandboxed)."""
