"""The bottom of the frontend: the OpenAI request bodies every layer speaks, and the errors."""
