"""The Anthropic Messages face (/v1/messages): its bodies and its translation to the chat
pipeline."""
