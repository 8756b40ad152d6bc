"""The bash reader: quote command lines, and read a pasted one the way bash does."""
