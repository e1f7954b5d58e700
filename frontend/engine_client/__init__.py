"""The links to the engines: the client, placement, request tracking and their metrics."""
