"""How the user's model is built and how it runs: one traced forward, its blocks, linears and their roles, head
counts, layer kinds, the hooks a model may define, and Hugging Face configs read offline (no process group)."""
