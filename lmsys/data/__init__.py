"""Text to training batches: the corpus readers, the tokenizers (SentencePiece, tokenizer.json),
the prepared-data format (shards.py), preparing it (preparation.py) and the training loader."""
