"""Measurement harnesses and their reports; ``moa_serve/commands/`` holds their thin CLI entry points."""
