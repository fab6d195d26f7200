"""Speculation: horizon heads, proposers, sparse trees, exact verification, the speculative
engine and the capacity profile that sizes its trees."""
