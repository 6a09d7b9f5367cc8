"""The range engine: a job's files cut into spans, read by a pool of readers and landed in
sinks.

How big spans are and in which order they are read (:mod:`.spans`), how many readers
read at once (:mod:`.concurrency`), retrying transient errors (:mod:`.retry`), what a
sink is (:mod:`.sinks`), and the executor itself (:mod:`.executor`). Knows nothing of
jobs, locks, safetensors or tensors.
"""
