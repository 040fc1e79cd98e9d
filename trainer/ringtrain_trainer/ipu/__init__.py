"""The emulated IPU: a device with fixed memory that compiles a program once and runs it every step.

``device`` (the IPU: compile cache, host streams, replicas, gradient streaming), ``config`` (what
it is configured with and counts), ``shards`` (host threads in lock step), ``accumulate``
(gradient accumulation), ``pipeline`` (one model over several IPUs), ``memory`` (the memory plan
and its report), ``build`` (replicas or a pipeline, chosen once). It imports the engine and
nothing above it.
"""
