"""Model building blocks shared by the AR and DiT services (DESIGN.md section 9).

presets (pure Python), layers, parallel (tensor parallel linear layers), ulysses (sequence
parallel all-to-all), loader (safetensors with explicit key maps), paged_attention (#7).
This package's __init__ imports nothing heavy: `import kvrelay.models.presets` must not pull torch.
"""
