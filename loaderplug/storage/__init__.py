"""Storage: what the machine's filesystems are and how a file is read or written.

Which mount holds a path and how to read it (:mod:`.mounts`), opening a source and
reading it with ``pread`` (:mod:`.source`), how much of a file the page cache holds
(:mod:`.residency`), and small files and links replaced whole (:mod:`.atomic`); objects
in a store named by URL (:mod:`.object_urls`), its client (:mod:`.object_store`) and the
objects a job reads by ranged GETs (:mod:`.object_source`).
Imports only the vocabulary (the package root).
"""
