"""aotgen: compile an LLM checkpoint ahead of time into packages that run without model code."""

__version__ = "0.1.0"
