"""`sluice bench`'s entry point: picks the chat or the embeddings mode (both share the flags
and the client of sluice.bench.chat), runs it, prints the report."""

import argparse
import asyncio

import msgspec

from sluice.bench.chat import bench, config_from_args
from sluice.bench.embeddings import EmbedResult, bench_embeddings, format_embed_report
from sluice.bench.stats import BenchResult, format_report


def run_bench(args: argparse.Namespace) -> BenchResult | EmbedResult:
    """Entry point for `sluice bench`: run the load, print the report, return the result."""
    config = config_from_args(args)
    if getattr(args, "embeddings", False):
        embed = asyncio.run(bench_embeddings(config, args.batch_size))
        print(msgspec.json.format(msgspec.json.encode(embed), indent=2).decode() if args.json
              else format_embed_report(embed, config.base_url))
        return embed
    result = asyncio.run(bench(config))
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(result), indent=2).decode())
    else:
        print(format_report(result, config.base_url))
    return result
