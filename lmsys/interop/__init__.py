"""Models in and out: the export format (safetensors + config.json + tokenizer), Hugging Face
GPT-2 both ways, and lmsys's SentencePiece model as a tokenizer.json."""
