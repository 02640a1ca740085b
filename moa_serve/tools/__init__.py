"""Benchmarks, the network emulator and test harnesses: tools around the runtime, never imported by it."""
