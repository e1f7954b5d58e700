"""`sluice bench`: the benchmark client, over the public /v1 wire only (no tier imports it).

`chat.py`: streaming chat clients, their stats, report and the subcommand's flags;
`embeddings.py`: the `--embeddings` mode.
"""
