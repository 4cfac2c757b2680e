"""Patches of the Qwen3.5 modeling classes: packed candidates, shared prefixes, final-row last layer."""
