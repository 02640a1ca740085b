"""Training MoA drafters: data, masks, the training loop, self-distillation, diagnostics."""
