"""`edgespec train`: heads for any GGUF target, self-distilled and trained on this machine (the train extra)."""
