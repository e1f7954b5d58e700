"""The OpenAI face: chat completions, completions, /tokenize and /detokenize."""
