"""The input side: rendering, tokenization, budgets, media, bounds and structured output checks."""
