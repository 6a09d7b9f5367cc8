"""Ranks of one host sharing a load; who reads which file, how tensors reach the others,
the collectives, groups, peers and heartbeats."""
