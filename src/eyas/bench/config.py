"""BenchConfig: everything one benchmark run needs, validated once at the edge.

The same dataclass is what `eyas bench` builds from its flags, what `run_benchmark` takes, and what the result
carries back (`to_dict`) so a ledger record says exactly how the numbers were produced.
"""

from dataclasses import asdict, dataclass

from eyas.errors import EyasError

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class BenchConfig:
    url: str
    dataset: str = "mt-bench"
    model: str | None = None  # None: the first id the server lists at /v1/models
    num_prompts: int | None = None  # None: every prompt in the dataset
    concurrency: int | None = None  # closed loop; the default when request_rate is unset is 1
    request_rate: float | None = None  # open loop, Poisson arrivals per second
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    api_key: str | None = None
    endpoint: str = "chat"
    timeout_s: float = 600.0  # per request: a stalled stream becomes an error, not a hang
    progress: bool = True  # tqdm bar on stderr

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise EyasError(f"--url must start with http:// or https://, got {self.url!r}")
        # People paste the OpenAI base URL (…/v1); the routes below add /v1 themselves.
        self.url = self.url.rstrip("/").removesuffix("/v1")
        if self.concurrency is not None and self.request_rate is not None:
            raise EyasError("give --concurrency or --request-rate, not both")
        if self.request_rate is None and self.concurrency is None:
            # Batch size 1 is where speculative decoding is meant to win, so it is the default question.
            self.concurrency = 1
        if self.concurrency is not None and self.concurrency < 1:
            raise EyasError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise EyasError(f"--request-rate must be positive, got {self.request_rate}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise EyasError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if self.max_tokens < 1:
            raise EyasError(f"--max-tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature < float("inf"):
            raise EyasError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.warmup < 0:
            raise EyasError(f"--warmup must be >= 0, got {self.warmup}")
        if self.endpoint not in ENDPOINTS:
            raise EyasError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if not self.timeout_s > 0:
            raise EyasError(f"timeout_s must be positive, got {self.timeout_s}")

    @property
    def path(self) -> str:
        return ENDPOINTS[self.endpoint]

    @property
    def mode(self) -> str:
        if self.request_rate is not None:
            return f"request rate {self.request_rate:g}/s (Poisson)"
        return f"concurrency {self.concurrency}"

    def to_dict(self) -> dict:
        d = asdict(self)
        # A secret has no place in a ledger record; whether one was used is still worth knowing.
        d["api_key"] = "***" if self.api_key else None
        return d
