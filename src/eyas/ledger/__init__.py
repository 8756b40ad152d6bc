"""The run ledger: every recorded run, and what reads, compares, replays and tunes from it."""
