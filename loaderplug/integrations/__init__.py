"""Glue between loaderplug and the frameworks people load models with.

Each module imports its framework only when used, and says how to install it if missing.
"""
