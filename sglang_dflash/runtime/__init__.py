"""Model execution below the scheduler: forward batches, attention, the model runner, tokenizers."""
