"""The application's configuration; `build_app` validates YAML and Python input the same way.

Every rule that a configuration can break is checked when the application is built
(`RolloutAppConfig.parse`), and a broken one fails `build_app` with an `AppConfigError` naming the
field: not every request, nor every worker replica at start.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from rollout.calibration import STARTUP_BUDGET_S
from rollout.encoding_cache import ENCODING_CACHE_BYTES
from rollout.errors import (
    FieldError,
    InvalidRequestError,
    ModelLoadError,
    clip,
    short_repr,
)
from rollout.micro_batching import MicroBatching, parse_image_size
from rollout.models.choice import EMBEDDED_MODEL, check_model_choice
from rollout.plan import RequestLimits
from rollout.schema import RequestValidation
from rollout.scorers.registry import BUILT_IN as BUILT_IN_SCORERS
from rollout.weights import weight_version_problem

if TYPE_CHECKING:
    from rollout.cost import CostFacts

AUTH_TOKEN_ENV = "ROLLOUT_AUTH_TOKEN"


def token_from_environment() -> SecretStr | None:
    token = os.environ.get(AUTH_TOKEN_ENV)
    return SecretStr(token) if token else None


class AppConfigError(FieldError):
    """The application's configuration breaks a rule: raised by `build_app`, naming the field."""


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        None,
        description="Model, as `rollout.models.registry` knows it: the embedded model, 'sd3', 'flux', "
        "'qwenimage', 'wan' or 'ltx'. None: read the family from `path`'s model_index.json (the embedded model without a path).",
    )
    path: str | None = Field(
        None, description="Local diffusers directory to load from (on every worker node); None: the packaged weights."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Model weights' dtype; latents and log-probs are fp32 whatever it is."
    )
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Rows per transformer call (the sampler pads to it): a sample is one row, or two under "
        "classifier-free guidance for models that run both branches in one call (SD3, LTX-Video, the embedded "
        "model); None: the model's default.",
    )
    micro_batch_sizes: dict[str, int] = Field(
        default_factory=dict, description="Rows per transformer call by image size, e.g. {'1024x1024': 4}."
    )
    decode_batch_size: int | None = Field(
        None,
        ge=1,
        description="Images per VAE call (the decode pads to it, with 'padding'); None: the transformer's micro-batch "
        "for the image size.",
    )
    decode_batch_sizes: dict[str, int] = Field(
        default_factory=dict, description="Images per VAE call by image size, e.g. {'1024x1024': 4}."
    )
    batch_invariance: Literal["padding", "kernels"] = Field(
        "padding",
        description="What keeps a sample's bits independent of its companions: 'padding' (every call takes "
        "exactly the micro-batch's rows, stock kernels) or 'kernels' (calls take the rows there are, at most "
        "the micro-batch, under batch-invariant kernels, checked on the device when each worker starts); see "
        "rollout/kernels.py and docs/throughput.md for which is faster for which load.",
    )
    max_sequence_length: int | None = Field(
        None, ge=1, description="Text tokens every prompt is padded or truncated to; None: the family's default."
    )
    vae_tiling: bool | None = Field(
        None,
        description="Decode with the VAE's own spatial tiling (diffusers' `enable_tiling`; frames above the VAE's "
        "tile size only). None: on for video families (wan, ltx), off for image families.",
    )
    attention_backend: Literal["default", "math", "flash", "efficient", "cudnn"] = Field(
        "default",
        description="The attention kernel the denoisers run (rollout.kernels.AttentionBackend): 'default' lets "
        "PyTorch pick per call; the others pin one. A trainer replays with the same one (load_pipeline's "
        "attention_backend); a worker refuses to start where it has no kernel.",
    )
    encoding_cache_mib: int = Field(
        ENCODING_CACHE_BYTES // 2**20,
        ge=0,
        description="Host memory (MiB) each worker replica keeps prompt and image encodings in, reused by later "
        "requests with the same prompt, images and size (the same tensors); 0: none. Diffusers families only.",
    )
    calibration_budget_s: float = Field(
        STARTUP_BUDGET_S,
        ge=0,
        le=3600,
        description="Seconds a worker replica may spend at start-up measuring the transformer's and the VAE's "
        "micro-batch sizes (rollout.calibration.calibrate_at_start) for the model's default image size and each of "
        "`calibration_sizes` whose `micro_batch_sizes` entry is not given; 0, or a `micro_batch_size`: none. Image "
        "families from a diffusers directory only (not the embedded model, whose bits are the reference digests, "
        "nor video families). Replicas keep the result on disk and serve the sizes the first of them measured.",
    )
    calibration_sizes: list[str] = Field(
        default_factory=list, max_length=16, description="Image sizes to calibrate at start-up besides the default, e.g. ['1024x1024']."
    )
    calibration_cache_dir: str | None = Field(
        None,
        description="Directory (on each worker node) the start-up calibrations are kept in between starts; None: "
        "$XDG_CACHE_HOME (else ~/.cache)/diffusion-rollout/calibration.",
    )
    # On a cluster the builder may run on a node without the weights (a CPU head, GPU workers scaled
    # to zero): there a bad directory can only fail the worker replicas' start.
    check_path_at_build: bool = Field(
        True,
        description="Check `path` when the app is built (it exists and holds the model), so that a bad one fails "
        "the start at once; false where only the worker nodes have the directory.",
    )

    @field_validator("calibration_sizes")
    @classmethod
    def _calibration_sizes_parse(cls, sizes: list[str]) -> list[str]:
        for size in sizes:
            if parse_image_size(size) is None:
                raise ValueError(f"sizes look like '512x512', got {clip(size)!r}")
        return sizes

    @field_validator("micro_batch_sizes", "decode_batch_sizes")
    @classmethod
    def _sizes_parse(cls, sizes: dict[str, int]) -> dict[str, int]:
        try:
            MicroBatching.parse(1, sizes)
        except InvalidRequestError as error:
            raise ValueError(error.reason) from None
        return sizes

    @model_validator(mode="after")
    def _loadable(self) -> "ModelConfig":
        try:
            check_model_choice(self.name, self.path, self.max_sequence_length, self.vae_tiling)
        except ModelLoadError as error:
            raise ValueError(f"{error.field.removeprefix('model.')}: {error.reason}") from None
        return self

    def label(self) -> str:
        """The model's name for discovery endpoints: its name, else its directory's."""
        if self.name is not None:
            return self.name
        return EMBEDDED_MODEL if self.path is None else Path(self.path).name

    def described(self) -> str:
        """The model and where its weights come from, for the ready lines: `flux (/models/flux)`."""
        return f"{self.label()} ({self.path or 'packaged weights'})"

    def sizes_to_calibrate(self, default_size: tuple[int, int]) -> list[tuple[int, int]]:
        """The image sizes a worker replica measures micro-batch sizes for at start-up: the model's
        default and `calibration_sizes`, less those the configuration gives sizes for."""
        if self.calibration_budget_s == 0 or self.micro_batch_size is not None:
            return []
        given = set(MicroBatching.parse(1, self.micro_batch_sizes).by_size)
        sizes = [default_size, *map(parse_image_size, self.calibration_sizes)]
        return [size for size in dict.fromkeys(sizes) if size not in given]

    def micro_batching(self, model_default: int) -> MicroBatching:
        """The configured micro-batches and batch invariance; sizes not listed keep `micro_batch_size`,
        else `model_default`, and decode in calls of `decode_batch_size`, else the transformer's size."""
        return MicroBatching.parse(
            self.micro_batch_size or model_default,
            self.micro_batch_sizes,
            self.batch_invariance,
            self.decode_batch_size,
            self.decode_batch_sizes,
        )


def nest_dotted_keys(args: dict) -> dict:
    """`args` with each dotted key's value moved under its parents; the caller's dicts are left as they were."""
    nested = {key: value for key, value in args.items() if not (isinstance(key, str) and "." in key)}
    for key, value in args.items():
        if key in nested:
            continue
        *parents, leaf = key.split(".")
        level = nested
        for depth, part in enumerate(parents):
            child = level.get(part, {})
            if not isinstance(child, dict):
                raise AppConfigError(
                    clip(".".join(parents[: depth + 1])), f"set both whole and by {clip(key)}: give one"
                )
            parent, level = level, dict(child)
            parent[part] = level
        if leaf in level:
            raise AppConfigError(clip(key), "set twice, by its dotted key and inside its parent: give it once")
        level[leaf] = value
    return nested


# A scorer's name is a key of rows' `rewards`, a Serve deployment's name and a log's word.
SCORER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")


class ScorerConfig(BaseModel):
    """One scorer of the application: its own Serve deployment (`deployments/scorer.py`)."""

    model_config = ConfigDict(extra="forbid")

    kind: str = Field(
        description=f"A built-in scorer ({', '.join(sorted(BUILT_IN_SCORERS))}) or a user's class as "
        "'package.module:Class' (rollout/scorers/base.py says what it must have)."
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the scorer's constructor.")
    num_replicas: int = Field(1, ge=1, description="Replicas of the scorer's deployment.")
    num_cpus: float = Field(0.5, ge=0, description="CPUs each replica reserves.")
    num_gpus: float = Field(0, ge=0, description="GPUs each replica reserves (fractions share one).")
    max_batch_size: int = Field(
        64, ge=1, description="Most samples in one scorer call; waiting parts of any requests are scored together."
    )
    timeout_s: float = Field(60.0, gt=0, description="Seconds one part's scoring may take before it counts as failed.")
    retry_attempts: int = Field(
        3, ge=1, description="Tries of a part's scoring whose replica dies (the samples are kept and scored again)."
    )

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, kind: str) -> str:
        if kind not in BUILT_IN_SCORERS and not IMPORT_PATH.fullmatch(kind):
            raise ValueError(f"must be one of {sorted(BUILT_IN_SCORERS)} or 'package.module:Class', got {short_repr(kind)}")
        return kind


class RolloutAppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    app_name: str = Field("rollout", description="Serve application name, for `serve.get_app_handle`.")
    # A SecretStr, so the token shows as '**********' in a repr, a log line or a dump of the config.
    auth_token: SecretStr | None = Field(
        default_factory=token_from_environment,
        min_length=1,
        description="Bearer token every HTTP route except /liveness requires (401 without it); the handle "
        f"needs none. Unset: {AUTH_TOKEN_ENV} from the environment of the process that builds the app, if set.",
    )
    allow_unauthenticated: bool = Field(
        False,
        description="Without auth_token, let clients on other machines call the routes that change or read the "
        "served weights and memory, and let `python -m deployments serve` listen on a host other than loopback.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    served_model_name: str | None = Field(
        None, description="Name reported by `/v1/models` and `/server_info`; None: the model's name."
    )
    weight_version: str = Field("0", description="Name of the weights served at start; every sample reports its version.")
    allowed_weight_paths: list[str] = Field(
        default_factory=list,
        description="Directories that weight updates may read checkpoints from: the path and every file read, "
        "symlinks resolved, must be under one. Empty (the default): any path the server's user can read, as SGLang.",
    )
    allowed_image_paths: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list,
        description="Directories that a request's image_path may name files in: the path, symlinks resolved, must be "
        "under one. Empty (the default): file paths are refused; images come inline (base64, bytes, tensors). "
        "Unlike weight paths, a client names these, so none is read unless an operator chose where.",
    )
    weight_update_timeout_s: float = Field(
        600.0, gt=0, description="How long an update waits for every replica before it is undone everywhere."
    )
    # A replica connects to the address a trainer names in /init_weights_update_group: only to
    # those an operator lists, so that the route cannot make the cluster dial anywhere else.
    allowed_weight_sync_addresses: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda: ["127.0.0.1"],
        description="Addresses a trainer's weight-update group (master_address) may be at; add the trainer's "
        "node's address where it runs on another machine.",
    )
    num_worker_replicas: int = Field(2, ge=1, description="Worker replicas, one pipeline each.")
    worker_num_cpus: float = Field(0.5, gt=0, description="CPUs each worker replica reserves.")
    worker_num_gpus: float | None = Field(
        None, ge=0, description="GPUs each worker replica reserves; None: 1 if the cluster has GPUs, else 0."
    )
    worker_torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per worker replica.")
    worker_max_replicas_per_node: int | None = Field(
        None, ge=1, description="Most worker replicas on one node (1 spreads them over the nodes); None: no limit."
    )
    ingress_num_cpus: float = Field(0.25, gt=0, description="CPUs the ingress replica reserves.")
    # Serve's default is 20 s. `serve run`'s Ctrl-C stops the ingress, then the workers, then takes
    # 5-6 s more to exit here: it exited in 8.3-8.8 s with work cut at both (9.0-9.2 s at 2 s).
    graceful_shutdown_timeout_s: float = Field(
        1.5,
        ge=0,
        description="How long a stopping ingress or worker replica (Ctrl-C, serve.delete, a redeploy) keeps "
        "serving its requests in flight before Serve kills it.",
    )
    worker_health_check_period_s: float = Field(
        10.0,
        gt=0,
        description="How often Serve checks each worker replica (Serve's health_check_period_s); a replica "
        "whose last sampler calls all failed fails the check and is replaced.",
    )
    # The ingress only plans requests and awaits the workers, so it takes many at once: Serve's
    # default of 5 queued concurrent one-sample requests behind each other, so they reached the
    # workers in waves and could not share sampler calls.
    ingress_max_ongoing_requests: int = Field(
        256, ge=1, description="Requests the ingress replica handles at once (Serve's max_ongoing_requests)."
    )
    max_batch_size: int = Field(32, ge=1, description="Most samples in one sampler call on a worker.")
    # A busy worker takes everything waiting as soon as it frees up (deployments/batching.py);
    # this wait only lets requests sent together reach an idle worker together.
    batch_wait_timeout_s: float = Field(
        0.25,
        ge=0,
        description="How long an idle worker waits for concurrent work to fill its micro-batches while the "
        "ingress has other samples in flight.",
    )
    batch_lone_wait_s: float = Field(
        0.05,
        ge=0,
        description="How long after the last arrival an idle worker waits with work the ingress sent while it had "
        "nothing else in flight: a lone request, or the first of a burst whose rest is milliseconds behind.",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Seconds a request may take unless it gives rollout_timeout_s; then HTTP 504."
    )
    worker_retry_attempts: int = Field(
        3, ge=1, description="Tries of a request's part whose worker replica dies (sampling is seeded: same bits)."
    )
    max_queued_cost: int | None = Field(
        None,
        ge=1,
        description="Token-steps (rollout/cost.py) of the requests the ingress admitted whose parts the workers "
        "have not all answered, beyond which requests are refused with 503 (HTTP) or OverloadedError (handle), "
        "unless their client stays within its fair share (this over the clients with work in flight); None: 4 "
        "full batches per worker replica of samples at the model's defaults and limits.default_inference_steps.",
    )
    scorers: dict[str, ScorerConfig] = Field(
        default_factory=dict,
        description="Scorers by the name requests give in rollout_reward_models, each its own deployment, e.g. "
        "{'pickscore': {'kind': 'clip', 'options': {'path': '/models/pickscore', 'kind': 'pickscore'}, "
        "'num_gpus': 0.25}}. Left out, the embedded model comes with its own two, 'ink' and 'digits'.",
    )
    keep_unscored_s: float = Field(
        300.0,
        ge=0,
        description="Seconds the samples of an HTTP request with a seed whose scoring failed are kept, so that the "
        "same request sent again is scored from them rather than sampled again; 0: not kept.",
    )
    # They stay in Ray's object store while kept: 16 requests at most, and this many bytes.
    max_unscored_bytes: int = Field(
        4 * 2**30,
        ge=1,
        description="Bytes of the samples kept for requests whose scoring failed (keep_unscored_s), in all; past it "
        "the oldest are dropped first, and a request larger alone is not kept.",
    )
    probe_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="Port on which the ingress replica itself answers GET /health and /liveness, outside "
        "Serve's HTTP proxy, so that no load delays them (docs/reliability.md); None: only Serve's port does.",
    )
    probe_host: str = Field(
        "127.0.0.1", description="Interface the probe port listens on ('0.0.0.0': reachable from other machines)."
    )
    limits: RequestLimits = Field(default_factory=RequestLimits)
    # Checked before a body is read (its Content-Length) and while it is read (a chunked body), so a
    # client cannot make the ingress hold more than this. A request of 64 long prompts is ~100 KB;
    # parsing a hostile 16 MiB body (8M numbers) held the ingress's event loop for 1.1 s here, 1 MiB 70 ms.
    max_request_body_bytes: int = Field(
        2**20, ge=1, description="Largest body of a POST request, except weight updates from tensors (413 beyond)."
    )
    # Weight bodies are larger than requests (a LoRA adapter of a real family is tens to hundreds of
    # MB); whole checkpoints of real models go through the handle and the object store instead.
    max_weight_update_body_bytes: int = Field(
        1 * 2**30, ge=1, description="Largest body of POST /update_weights_from_tensor (413 beyond)."
    )
    # Serve's proxy streams a body to the ingress as the client sends it, and a stalled client holds
    # one of the ingress's `ingress_max_ongoing_requests` slots meanwhile: these bound how long and
    # how many (docs/reliability.md). A trainer's burst sends its bodies in milliseconds.
    body_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a client may take to send a body, except weight updates from tensors (408 beyond)."
    )
    weight_update_body_timeout_s: float = Field(
        600.0, gt=0, description="Seconds a client may take to send the body of POST /update_weights_from_tensor (408 beyond)."
    )
    max_unfinished_bodies: int = Field(
        128, ge=1, description="Bodies the ingress receives at once; more are refused (503, Retry-After) until one is in."
    )
    max_unfinished_bodies_per_client: int = Field(
        32,
        ge=1,
        description="Bodies the ingress receives at once from one client address (behind a reverse proxy, the "
        "proxy's); more are refused (503, Retry-After).",
    )
    # The count alone lets 128 bodies of up to 1 GiB each (tensor updates) be received at once.
    max_unfinished_body_bytes: int = Field(
        2 * 2**30,
        ge=1,
        description="Bytes of the bodies the ingress receives at once, each counted at its Content-Length (a chunked "
        "one at its size limit); a body past it is refused (503, Retry-After) until others are in.",
    )
    request_validation: RequestValidation = Field(
        "strict",
        description="strict: refuse unknown request fields and mistyped values (422, naming the field). "
        "sglang: SGLang's lenient pydantic, which drops unknown fields and coerces values where it can.",
    )

    @classmethod
    def parse(cls, args: "dict | RolloutAppConfig | None") -> "RolloutAppConfig":
        """`args` validated; raises `AppConfigError` naming the first field that breaks a rule.

        A dotted key sets a nested field, as `serve run`'s key=value args can only give flat strings:
        {"model.path": "/models/x"} is {"model": {"path": "/models/x"}}.
        """
        if isinstance(args, cls):
            return args
        try:
            return cls.model_validate(nest_dotted_keys(args or {}))
        except ValidationError as error:
            problem = error.errors(include_url=False)[0]
            location = [str(part) for part in problem["loc"]]
            message = problem["msg"].removeprefix("Value error, ")
            # A cross-field rule's message starts with the field it is about: "default_inference_steps: ...".
            head, _, rest = message.partition(": ")
            if rest and head.isidentifier() and head not in location:
                location, message = [*location, head], rest
            value = "" if problem["type"] in ("missing", "value_error") else f", got {short_repr(problem.get('input'))}"
            if problem["type"] == "model_type" and isinstance(problem.get("input"), str):
                value += f"; set its fields by dotted keys: {'.'.join(location)}.<field>=<value>"
            raise AppConfigError(clip(".".join(location) or "config"), f"{message}{value}") from None

    @property
    def probe_url(self) -> str | None:
        """Where the probe port answers, for the ready lines; None without one."""
        return None if self.probe_port is None else f"http://{self.probe_host}:{self.probe_port}"

    @field_validator("weight_version")
    @classmethod
    def _a_weight_version_name(cls, version: str) -> str:
        if problem := weight_version_problem(version):
            raise ValueError(problem)
        return version

    @model_validator(mode="after")
    def _slots_left_for_others(self) -> "RolloutAppConfig":
        if self.max_unfinished_bodies >= self.ingress_max_ongoing_requests:
            raise ValueError(
                f"max_unfinished_bodies: must be below ingress_max_ongoing_requests ({self.ingress_max_ongoing_requests}), "
                "so that clients slow to send their bodies cannot hold every slot of the ingress"
            )
        largest = max(self.max_request_body_bytes, self.max_weight_update_body_bytes)
        if self.max_unfinished_body_bytes < largest:
            raise ValueError(
                f"max_unfinished_body_bytes: must be at least the largest body allowed ({largest}, "
                "max_request_body_bytes and max_weight_update_body_bytes), or such a body could never be received"
            )
        return self

    @model_validator(mode="after")
    def _embedded_models_scorers(self) -> "RolloutAppConfig":
        if "scorers" not in self.model_fields_set and self.model.path is None and self.model.name in (None, EMBEDDED_MODEL):
            self.scorers = {name: ScorerConfig(kind=name, num_cpus=0.1) for name in ("ink", "digits")}
        return self

    @field_validator("scorers")
    @classmethod
    def _scorer_names(cls, scorers: dict[str, ScorerConfig]) -> dict[str, ScorerConfig]:
        for name in scorers:
            if not SCORER_NAME.fullmatch(name):
                raise ValueError(f"names are 1-64 letters, digits, '_', '.' or '-', got {short_repr(name)}")
        return scorers

    def queued_cost_limit(self, facts: CostFacts) -> int:
        """`max_queued_cost`, else its default for the model `facts` describe."""
        if self.max_queued_cost is not None:
            return self.max_queued_cost
        samples = 4 * self.num_worker_replicas * self.max_batch_size
        return samples * facts.sample_cost(self.limits.default_inference_steps).token_steps

    def max_ongoing_requests_per_worker(self) -> int:
        # Serve caps a replica's batch at its ongoing requests: allow a full batch of
        # one-sample requests plus as many queued behind it.
        return 2 * self.max_batch_size
