"""`sluice bench`: the benchmark client, over the public /v1 wire only (no tier imports it).

`chat.py`: streaming chat clients, their stats and report, and the subcommand's flags;
`embeddings.py`: the `--embeddings` mode over chat's client; `command.py`: the entry point,
which picks the mode (so neither mode imports the other).
"""
