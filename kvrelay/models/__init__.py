"""Every model the services host (DESIGN.md section 9): the AR and DiT services only run them.

Models: ar (the built-in Llama-style AR), dit (the built-in DiT and DitRunner), bagel (BAGEL MoT
modules and checkpoint format) with bagel_runner (its DiT runner), vae (decoders, scheduler),
sampler (flow-matching Euler with CFG), tokenizer, image (PNG encode/decode), demo (the bundled
demo model's world). Building blocks: presets (pure Python), layers, parallel (tensor parallel
linear layers), moe, ulysses (sequence parallel all-to-all), paged_attention (#7). Checkpoint
formats: loader (safetensors with explicit key maps), formats (which model a `model:` entry
names, no torch). Measurement entry points live in benchmarks/, not here.
This package's __init__ imports nothing heavy: `import kvrelay.models.presets` must not pull torch.
"""
