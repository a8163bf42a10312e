"""The OpenAI-compatible gateway that trains an agent through its own API calls (``spec.agent``)."""
