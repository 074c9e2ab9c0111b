"""llmgw: one OpenAI-compatible endpoint over a fleet of GPU nodes."""

__version__ = "0.1.0"
