"""`eyas bench`: benchmark an OpenAI-compatible endpoint (eyas, SGLang, vLLM) and print one table or one JSON object.

Usage: eyas bench --url http://127.0.0.1:8000 --dataset mt-bench --num-prompts 80 --concurrency 1 --max-tokens 256
"""

import json

from eyas.bench.client import run_benchmark
from eyas.bench.config import ENDPOINTS, BenchConfig

__all__ = ["add_arguments", "run", "run_benchmark"]


def add_arguments(parser):
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to request (default: the first id at /v1/models)")
    parser.add_argument("--dataset", default="mt-bench", help="mt-bench, humaneval, or PATH.jsonl")
    parser.add_argument("--num-prompts", type=int, help="how many prompts (default: the whole dataset)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 1)")
    load.add_argument("--request-rate", type=float, help="open loop: Poisson arrivals per second")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="prompt sampling, arrival times, and the request seed")
    parser.add_argument("--warmup", type=int, default=1, help="requests sent first and left out of the results")
    parser.add_argument("--api-key", help="sent as a bearer token")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="chat")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args) -> int:
    config = BenchConfig(
        url=args.url,
        model=args.model,
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        warmup=args.warmup,
        api_key=args.api_key,
        endpoint=args.endpoint,
    )
    result = run_benchmark(config)
    print(json.dumps(result.to_dict()) if args.json else result.table())
    # A run where nothing succeeded measured nothing; scripts should notice.
    return 0 if result.completed else 1
