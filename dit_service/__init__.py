"""kvrelay.dit_service: the DiT stage: KV prefix in broker-owned pages in, PNG out.

Owns one DiT replica process (main.py), its membership with the broker (registration.py), the
page memory the AR writes into (memory.py: one host pool per rank), admission of Denoise calls
in reservation order (scheduler.py), DitService (service.py: Denoise, the PutKv fallback and the
DiT side of the request protocol: verify the rows, report loads, step, release the ticket), the
rank workers (engine.py), the built-in DiT, sampler and decoder (model.py, sampler.py) and PNG
encoding (image.py). It never imports the AR service (an import contract).
"""
