"""kvrelay.broker: the one authority over DiT pages, tickets and replicas, and the public API.

Owns who is registered (registry.py: incarnations, leases, fences), which DiT page is free,
reserved or draining (pool.py), the transfer ticket state machine (tickets.py) and their
composition with the write-ahead journal (core.py, journal.py, the ticket record in codec.py, the
asyncio waiters on changes in waiters.py), served as BrokerService (service.py); and every
generation from QUEUED to its end: admission and the FIFO queue (admission.py), placement
(placement.py), the stage pipeline (pipeline.py), wired by the orchestrator (orchestrator.py), the
generation store (generations.py), the public GenerationService with its detach rule
(generation.py), the proto enum mapping (wire.py), metrics (metrics.py) and the `kvrelay broker`
process (main.py). It moves no KV bytes and runs no model: it never imports torch or a model
service (an import contract); the AR and DiT replicas call it.
"""
