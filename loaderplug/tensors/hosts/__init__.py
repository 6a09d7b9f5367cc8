"""Hosts sharing a load; whether they split the mirror's reads, and the rounds in
which each host reads its part and receives the rest."""
