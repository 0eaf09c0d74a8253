"""Decode tokens/s and ms per step of the real engine per batch size against the memory roofline measured in
the same run, transformers' ``generate`` on the same weights, and one long prompt's prefill against the matmul
ceiling: ``kvferry bench decode``, stamped.

Per batch size (``--batch``, default 1 32 128): ``batch`` requests of ``--prompt-tokens`` random tokens each
generating ``--new-tokens`` greedy tokens through ``build_engine`` + ``engine.generate``, ``--repeat`` times;
the time of a step is the engine's own step statistics of the pure decode steps. Per row: ``tokens_per_s``,
``ms_per_step`` (median, ``_spread`` ``[min, max]``), ``roofline_ms`` (the bytes a decode step must move: weights,
every sequence's KV and Mamba2 state, logits; over the same-run ``tensor.copy_`` bandwidth) and
``roofline_ratio``; ``hf_tokens_per_s`` and ``vs_transformers`` (end to end, prefill included, both sides).
``prefill``: ``--prefill-tokens`` in chunks of ``--max-prefill-chunk`` against the same-run matmul rate times
the model's FLOPs per token. See :mod:`kvferry.tools.decode_bench`.

    python benchmarks/decode.py [--device cpu|cuda] [--model tiny|nemotron-h-1b|nemotron-h-8b|DIR]
        [--dtype bfloat16] [--batch 1 32 128] [--prompt-tokens 128] [--new-tokens 64] [--repeat 3]
        [--prefill-tokens 8192] [--max-prefill-chunk 512] [--no-transformers]
        [--decode-graphs auto|on|off] [--launch-on-loop auto|on|off] [--json benchmarks/results/<machine>/decode.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import sys

from _provenance import write_result

from kvferry.commands import bench_decode
from kvferry.commands._common import say
from kvferry.tools.decode_bench import plot, run_decode_bench, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    bench_decode.add_arguments(parser)
    args = parser.parse_args()
    bench_decode.validate(args)
    result = run_decode_bench(bench_decode.config_of(args), say)
    print(table(result))
    if args.json:
        body = {k: v for k, v in result.items() if k not in ("benchmark", "rows")}
        body["results"] = result["rows"]
        write_result(args.json, "decode", body, result["config"]["device"].split(":")[0])
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
