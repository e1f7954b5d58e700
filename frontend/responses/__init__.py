"""The Responses face (/v1/responses): its bodies and its translation to the chat pipeline."""
