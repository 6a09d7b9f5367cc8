"""Test helpers for loaderplug (FUSE-backed slow, faulty test volumes)."""
