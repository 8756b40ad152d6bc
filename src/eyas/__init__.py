"""eyas: EAGLE-3 speculative decoding, end to end."""

__version__ = "0.1.0"
