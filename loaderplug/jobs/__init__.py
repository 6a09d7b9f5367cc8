"""Jobs: what a hydrate, a sync or a load does around the engine.

A job is a :class:`~.plan.Plan` run by the :mod:`.runner` (locks, leftovers of a killed
run, the current-copy rule, the engine, publishing, the report). The copy planners
(:mod:`.copies`) build plans from folders; the rest is what they need: locks, the
mirror's manifest and sync mark, partial copies, content digests, folder walks.
"""
