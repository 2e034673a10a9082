"""KV transfer plane: page layout, planner, packing, checksums and transports (DESIGN.md sections 3-5)."""
