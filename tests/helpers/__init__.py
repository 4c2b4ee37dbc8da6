"""Test helpers that write checkpoints and containers without going through colibri."""
