"""kvrelay.ar_service: the AR stage: prompt in, KV prefix written into broker-owned DiT pages.

Owns one AR replica process (main.py: lock, workers, registration, serve), its membership with
the broker (registration.py: RegisterReplica, heartbeats, fences), ArService (service.py: Tokenize,
Prefill and the AR side of the request protocol), the rank workers that run the model and write
the KV (engine.py), the ledger of every write handed to this incarnation and its reports
(sender.py), the built-in Llama-style decoder (model.py) and the tokenizers (tokenizer.py). It
never imports the DiT service (an import contract); the two meet only through the broker's
tickets and the transfer plane (kvrelay.transfer).
"""
