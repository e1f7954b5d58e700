"""The HTTP tier, in wings by layer: http/ on top, then the protocol faces (openai/,
responses/, anthropic/, ...), pipeline/ (what every face shares), input/ and engine_client/,
base/ at the bottom. Imports run only downward; frontend/README.md says where a new route or
check goes."""
