"""LLM: the engine's entry point. Builds the stage of the model this rank runs, its weights, its communicator
and its worker (the model runner over the paged KV cache); then serves requests or runs fixed batches.

    llm = LLM("llama3.1-8b", EngineConfig(max_num_seqs=256), allreduce="nccl")
    outs = llm.generate(["Hello", [128000, 9906]], SamplingParams(max_tokens=16))   # the serving engine
    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16))  # through the chat template
    out = llm.generate_batch([[1, 2, 3]], SamplingParams(max_tokens=16))            # one fixed batch (study)

Both run on the same worker (spanllm.engine.worker: one runner, one cache, one attention backend):
- `generate` / `engine_core`: continuous batching (spanllm.engine.engine_core), per-request sampling, text in
  and out (pp = 1).
- `generate_batch`: one fixed batch on every pipeline stage (spanllm.engine.fixed_batch): `bench batch`,
  `bench study` and `generate --pp`.

Run it on every rank of a job (torchrun, or `spanllm.launch.launch` on CPU). The all-reduce is injected: pass
`comm=` (any object with `all_reduce_(x)`) or `allreduce=` (a name registered in `spanllm.comm`);
`allreduce_ran(batch)` names the algorithm that runs for a decode step of that batch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from spanllm.checks import ALLOW_LONG_CONTEXT_ENV
from spanllm.comm.topology import Topology
from spanllm.engine.config import EngineConfig
from spanllm.engine.fixed_batch import FixedBatchExecutor, GenerationOutput, build_token_groups
from spanllm.engine.sampler import BatchSampler, SamplingParams, seed_for_sample
from spanllm.engine.timers import Timers
from spanllm.errors import UsageError
from spanllm.kernels import gemv, pdl
from spanllm.kernels.skinny_gemm import MAX_M as SKINNY_MAX_M
from spanllm.kernels.skinny_gemm import describe_auto, table_id
from spanllm.layers.fp8 import MIN_FP8_CAPABILITY, check_fp8_device, describe_dispatch
from spanllm.layers.linear import linear_layers, quantize_fp8_
from spanllm.layers.tp import Communicator, TPContext
from spanllm.model.config import ModelConfig, resolve_model
from spanllm.model.llama import LlamaForCausalLM
from spanllm.model.loader import check_random_init_seed, load_checkpoint, random_init
from spanllm.model.parallel_dims import ParallelDims, ParallelGroups, build_groups, stage_layers


def default_device() -> torch.device:
    """cuda:LOCAL device when this process's group runs NCCL (or no group and a GPU), else CPU."""
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_allreduce(device: torch.device) -> str:
    """The group's own collective for this device (spanllm.comm.torch_dist.default_backend: the one rule)."""
    from spanllm.comm.torch_dist import default_backend

    return default_backend(device.type)


class LLM:
    def __init__(
        self,
        model: str | os.PathLike | ModelConfig,
        engine: EngineConfig | None = None,
        *,
        dims: ParallelDims | None = None,
        allreduce: str | None = None,
        comm: Communicator | None = None,
        device: torch.device | None = None,
        ranks_per_node: int | None = None,
        tuning=None,
    ) -> None:
        if isinstance(model, os.PathLike):  # a pathlib.Path of a checkpoint folder or .gguf file
            model = os.fspath(model)
        if not isinstance(model, (str, ModelConfig)):
            raise UsageError(
                f"model={model!r} ({type(model).__name__}) is not a model: give a preset name, an HF checkpoint "
                "folder, a .gguf file or a ModelConfig"
            )
        if engine is not None and not isinstance(engine, EngineConfig):
            raise UsageError(
                f"engine={engine!r} ({type(engine).__name__}) is not an EngineConfig: pass the engine's settings as "
                "EngineConfig(...), e.g. LLM(model, EngineConfig(max_model_len=2048))"
            )
        if isinstance(device, str):
            device = torch.device(device)
        elif device is not None and not isinstance(device, torch.device):
            raise UsageError(f"device={device!r} ({type(device).__name__}) is not a device: give 'cpu', 'cuda:0' ...")
        self.config = resolve_model(model) if isinstance(model, str) else model
        self.engine = engine or EngineConfig()
        if self.config.fp8_checkpoint is not None and self.engine.quantization is None:
            # the checkpoint's weights are FP8: the engine runs them so (vLLM: the checkpoint's config wins)
            self.engine = replace(self.engine, quantization="fp8")
        self.tuning = tuning  # spanllm.comm.tuning.TuningTable for nvrar / auto, or None
        self.device = device or default_device()
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.dims = dims or ParallelDims.tp_only(world)
        if self.dims.world_size != world:
            raise ValueError(f"{self.dims} needs {self.dims.world_size} ranks but this job has {world}")
        self.dims.validate_for(self.config)
        self.topology = Topology.from_env(world, ranks_per_node)
        self.dims.validate_for_topology(self.topology)
        if world > 1:
            self.groups = build_groups(self.dims, self.rank)
            self._token_group = build_token_groups(self.groups)
        else:
            self.groups, self._token_group = ParallelGroups(self.dims, 0, None), None

        self._owns_comm = False
        if comm is not None and allreduce is not None:
            raise ValueError("pass either comm= (an object) or allreduce= (a registered name), not both")
        if comm is None and self.dims.tp > 1:
            allreduce = allreduce or default_allreduce(self.device)
            comm = self._create_comm(allreduce)
            self._owns_comm = True
        self.comm = self._with_fallback(comm)

        # Per-op decode timers (bench batch's breakdown): attached to the model by hooks, off until enabled.
        self.timers = Timers(self.device, enabled=False, layer_spins=self.dims.pp == 1)
        self._check_decode_gemm()
        self.pdl = pdl.resolve(self.engine.pdl, self.device)  # the model's forward opens the scope (TPContext.pdl)
        fp8_checkpoint = self.config.checkpoint_dir is not None and self.config.fp8_checkpoint is not None
        if self.engine.quantization == "fp8":
            check_fp8_device(self.device, checkpoint=fp8_checkpoint)
        if self.engine.kv_dtype == torch.float8_e4m3fn and self.device.type == "cuda":
            cap = torch.cuda.get_device_capability(self.device)
            if cap < MIN_FP8_CAPABILITY:
                raise ValueError(
                    f"kv_cache_dtype='fp8' needs FP8 conversions on the GPU (compute capability >= 8.9); "
                    f"{torch.cuda.get_device_name(self.device)} has {cap[0]}.{cap[1]}. Use kv_cache_dtype='auto'"
                )
        tp = TPContext(
            rank=self.groups.tp_rank,
            size=self.dims.tp,
            group=self.groups.tp_group,
            comm=self.comm,
            decode_gemm=self.engine.decode_gemm,
            device=self.device,
            dtype=self.engine.dtype,
            fp8_weights=fp8_checkpoint,  # float8 weights and their scales, filled from the checkpoint as they are
            pdl=self.pdl,
        )
        g = self.groups
        layers = stage_layers(self.config.num_layers, self.dims.pp, g.stage)
        self.model = LlamaForCausalLM(self.config, tp, layers, g.is_first_stage, g.is_last_stage)
        if self.config.checkpoint_dir is not None:
            load_checkpoint(self.model, self.config.checkpoint_dir)
        else:
            check_random_init_seed(self.engine.seed, self.config.name, "EngineConfig seed=")
            random_init(self.model, self.engine.seed, self.rank)
        if fp8_checkpoint:
            for layer in linear_layers(self.model):
                layer.fp8_loaded_()
        elif self.engine.quantization == "fp8":
            quantize_fp8_(self.model)  # after loading: per-channel scales of the weights as loaded
        self._worker = None
        self._engine_core = None
        self._ran_fixed_batch = False  # generate_batch ran: describe() names its limits
        self._control_group = None
        self.tokenizer = None  # set by get_tokenizer() / the server
        self._closed = False  # close() ran: nothing runs on this LLM any more
        self._generating = False  # rank 0 is inside generate (its on_output may not call generate again)

    def _check_decode_gemm(self) -> None:
        """decode_gemm="skinny" runs a Triton kernel: refuse a machine without a GPU or Triton, no fallback."""
        if self.engine.decode_gemm != "skinny":
            return
        from spanllm.kernels import skinny_gemm

        if self.device.type != "cuda" or skinny_gemm.triton is None:
            raise ValueError(
                f"decode_gemm='skinny' needs a CUDA device and Triton; this rank has device "
                f"{self.device} and Triton {'installed' if skinny_gemm.triton else 'missing'}. "
                "Use decode_gemm='torch' (F.linear) here"
            )
        if self.engine.dtype not in skinny_gemm.SUPPORTED_DTYPES:
            raise ValueError(f"decode_gemm='skinny' supports {skinny_gemm.SUPPORTED_DTYPES}, not {self.engine.dtype}")

    # --- what runs ------------------------------------------------------------------------------------
    @property
    def allreduce_name(self) -> str:
        if self.dims.tp == 1:
            return "none"
        return getattr(self.comm, "name", type(self.comm).__name__)

    def allreduce_ran(self, batch: int) -> str:
        """The algorithm the communicator runs on a decode step's all-reduce ([batch, hidden] in the model dtype)."""
        if self.dims.tp == 1:
            return "none"
        probe = getattr(self.comm, "algorithm_for", None)
        if probe is None:
            return self.allreduce_name
        x = torch.empty(batch, 1, self.config.hidden_size, dtype=self.engine.dtype, device=self.device)
        return probe(x)

    def allreduce_ran_prefill(self, batch: int, prompt_len: int) -> str:
        """The algorithm that reduces a prefill all-reduce ([batch, prompt_len, hidden])."""
        if self.dims.tp == 1:
            return "none"
        x = torch.empty(batch, prompt_len, self.config.hidden_size, dtype=self.engine.dtype, device=self.device)
        probe = getattr(self.comm, "algorithm_for", None)
        return probe(x) if probe is not None else self.allreduce_name

    def _create_comm(self, name: str) -> Communicator:
        """A registered all-reduce on this rank's TP group (collective over the group)."""
        from spanllm.comm import create

        comm = create(
            name,
            group=self.groups.tp_group,
            topology=self.dims.tp_topology(self.topology),
            device=self.device,
            tuning=self.tuning,
            max_bytes=self.engine.allreduce_max_bytes,
        )
        if self.device.type == "cuda":  # nvrar's kernels for every size it may see, compiled in parallel now
            from spanllm.comm.nvrar.compile import precompile_sizes, size_ladder

            precompile_sizes(
                [comm], size_ladder(self.engine.allreduce_max_bytes // self.engine.dtype.itemsize), [self.engine.dtype]
            )
        return comm

    def _with_fallback(self, comm: Communicator | None) -> Communicator | None:
        """A buffered backend (nvrar, torch symm-mem: it declares max_bytes) takes decode-sized messages;
        larger ones (prefill) go to the group's own collective, as in the paper's engine: one communicator,
        spanllm.comm.fallback.SizeFallback (collective: builds the fallback). allreduce_ran_prefill() names it."""
        if self.dims.tp == 1 or getattr(comm, "max_bytes", None) is None:
            return comm
        from spanllm.comm.fallback import SizeFallback

        return SizeFallback(comm, self._create_comm(default_allreduce(self.device)))

    def _close_comm(self) -> None:
        """Close what this LLM owns: the communicator it created, and the fallback half it added."""
        comm = self.comm
        self.comm = None
        if comm is None:
            return
        from spanllm.comm.fallback import SizeFallback

        if isinstance(comm, SizeFallback):
            comm.fallback.close()
            comm = comm.primary
        if self._owns_comm:
            comm.close()

    def use_allreduce(self, name: str | None = None, comm: Communicator | None = None) -> None:
        """Swap the communicator the row-parallel layers call (by registered name, or an object), keeping
        weights and KV cache. Collective when it creates one. Captured decode graphs are dropped."""
        if self.dims.tp == 1:
            return
        if (name is None) == (comm is None):
            raise ValueError("pass exactly one of name= or comm=")
        if name is not None:
            comm = self._create_comm(name)
        self._close_comm()
        self._owns_comm = name is not None
        self.comm = self._with_fallback(comm)
        self.model.tp.comm = self.comm
        if self._worker is not None:
            self._worker.reset_graphs()

    @property
    def cuda_graphs(self) -> bool:
        return self.worker.use_cuda_graphs

    def describe(self, fixed_batch: bool | None = None) -> str:
        """The setup in one line (the server logs it; bench rows record it), with the limits of the executor in
        use: `fixed_batch` True for generate_batch's, False for the serving engine's; None: the one this LLM ran
        (the engine core built, else generate_batch called or pp > 1, where only fixed batches run)."""
        r = self.worker
        if r.use_cuda_graphs:
            graphs = f"on (buckets up to {self.engine.max_num_seqs})"
        elif self.device.type != "cuda" or not self.engine.cuda_graphs:
            graphs = "off"
        elif self.dims.pp > 1:
            graphs = "off (pipeline stages run eagerly)"
        else:
            graphs = f"off (the {r.backend.name} attention backend has none)"
        timers = " | per-op timers on (eager)" if self.timers.enabled else ""
        line = (
            f"{self.config.label} | {self.dims} | stage {self.groups.stage} layers "
            f"[{self.model.layer_ids.start}, {self.model.layer_ids.stop}) | {self.engine.dtype} on {self.device} | "
            f"all-reduce {self.allreduce_name} | attention {r.backend.describe(self.engine.dtype)} | "
            f"CUDA graphs {graphs}{timers}, {self.describe_pdl()} | "
            f"{self.kv_sizing.describe()}{self.describe_fp8_decode()}{self.describe_allocator()} | "
        )
        if fixed_batch is None:
            fixed_batch = self._engine_core is None and (self._ran_fixed_batch or self.dims.pp > 1)
        if fixed_batch:  # FixedBatchExecutor: no scheduler, only the prefill's token budget applies
            line += (
                f"fixed batch: prefill steps of <= {self.engine.max_num_batched_tokens} tokens "
                f"(max_num_batched_tokens), every decode step the whole batch (per micro-batch), "
                f"max_model_len {self.max_model_len}"
            )
            return line + f" | {self.describe_quantization()} | {self.describe_decode_gemm()}"
        line += (
            f"max_num_seqs {self.engine.max_num_seqs}, max_num_batched_tokens "
            f"{self.engine.max_num_batched_tokens}, max_model_len {self.max_model_len}"
        )
        if self._engine_core is not None:
            core = self._engine_core
            line += f", async scheduling {'on' if core.async_scheduling else 'off'}"
            line += f", prefix caching {'on' if core.blocks.enable_prefix_caching else 'off'}"
        if self.engine.min_admit > 1:
            line += f", min_admit {self.engine.min_admit}"
        if self.engine.scheduling_policy != "fcfs":
            line += f", scheduling policy {self.engine.scheduling_policy} (cached prefix families first, whole)"
        budget = self.engine.long_prefill_attention_budget
        line += f", prefill attention beside decodes {f'<= {budget:.3g} pairs a step' if budget else 'unlimited'}"
        cap = self.prefill_tokens_beside_decodes
        line += f", prefill tokens beside decodes {f'<= {cap} a step' if cap else 'unlimited'}"
        cap = self.long_prefill_token_threshold
        line += f", one prompt's prefill chunk {f'<= {cap} tokens' if cap else 'unlimited'}"
        return line + f" | {self.describe_quantization()} | {self.describe_decode_gemm()}"

    def _cpu_token_cap(self, value: int | None, cpu_default: int) -> int:
        """A scheduler token cap, auto (None) resolved: cpu_default on CPU, where a step's time is its tokens; 0 (no
        limit) on a GPU."""
        if value is not None:
            return value
        return cpu_default if self.device.type == "cpu" else 0

    @property
    def prefill_tokens_beside_decodes(self) -> int:
        from spanllm.engine.config import CPU_PREFILL_TOKENS_BESIDE_DECODES

        return self._cpu_token_cap(self.engine.prefill_tokens_beside_decodes, CPU_PREFILL_TOKENS_BESIDE_DECODES)

    @property
    def long_prefill_token_threshold(self) -> int:
        from spanllm.engine.config import CPU_LONG_PREFILL_TOKEN_THRESHOLD

        return self._cpu_token_cap(self.engine.long_prefill_token_threshold, CPU_LONG_PREFILL_TOKEN_THRESHOLD)

    def describe_fp8_decode(self) -> str:
        """What the Triton decode kernel widens an FP8 cache's keys and values to: fp16 or bf16 under bf16 queries
        (paged_attention.FP8_DECODE_WIDEN), else the queries' dtype."""
        if self.worker.backend.name != "triton" or self.kv_sizing.dtype != torch.float8_e4m3fn:
            return ""
        from spanllm.kernels import paged_attention

        to = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(self.engine.dtype)
        if paged_attention.decode_widens_to_f16(self.engine.dtype, torch.float8_e4m3fn):
            to = "fp16"
        return f", decode attention: keys and values widened to {to}"

    def describe_allocator(self) -> str:
        """On a GPU, the CUDA caching allocator's settings (spanllm.engine.cuda_allocator)."""
        from spanllm.engine import cuda_allocator

        return f", {cuda_allocator.describe()}" if self.device.type == "cuda" else ""

    def describe_pdl(self) -> str:
        if not self.pdl:
            return "PDL off"
        from spanllm.kernels.skinny_gemm import prefetch_budget

        budget = prefetch_budget()
        pf = f"skinny GEMMs prefetch up to {budget / 2**20:g} MiB of weights into L2 first" if budget else "no prefetch"
        return f"PDL on ({pf})"

    def describe_quantization(self) -> str:
        """The weights' format and, for FP8, which GEMM each row count runs."""
        if self.engine.quantization is None:
            return f"weights {self.engine.dtype}"
        where = "FP8 kernels" if self.device.type == "cuda" else "dequantized on CPU"
        ckpt = self.config.fp8_checkpoint
        kv_fp8 = self.engine.kv_dtype == torch.float8_e4m3fn
        origin = (
            f"from the {ckpt.describe(kv_fp8)}"
            if ckpt is not None and self.config.checkpoint_dir
            else "quantized at load"
        )
        one_row = ""
        if self.device.type == "cuda" and gemv.measured_table():
            one_row = f"; one row: {gemv.describe_one_row(self._layer_gemms())}"
        return (
            f"weights fp8 e4m3 per-channel, {origin} ({where}): {describe_dispatch()} (activations per token)"
            f"{one_row}; embedding and LM head {self.engine.dtype}; GEMM table {table_id()}"
        )

    def _layer_gemms(self, lm_head: bool = False) -> list[tuple[str, int, int, int]]:
        """(name, N, K, element bytes) of a decoder layer's weight GEMMs (and the LM head's)."""
        layer = next(iter(self.model.model.layers.values()), None)
        weights = []
        if layer is not None:
            a, mlp = layer.self_attn, layer.mlp
            weights += [
                ("qkv", a.qkv_proj.weight),
                ("o", a.o_proj.weight),
                ("gate_up", mlp.gate_up_proj.weight),
                ("down", mlp.down_proj.weight),
            ]
        if lm_head and self.model.lm_head is not None:
            weights.append(("lm_head", self.model.lm_head.weight))
        return [(name, *w.shape, w.element_size()) for name, w in weights]

    def describe_decode_gemm(self) -> str:
        """Which kernel each weight GEMM of a decode step with <= 16 rows runs (EngineConfig.decode_gemm), as
        TPContext decides it, e.g. 'decode GEMMs auto ...: skinny qkv, o, down; F.linear gate_up, lm_head'."""
        mode = self.engine.decode_gemm
        if self.engine.quantization is not None:
            return "decode GEMMs: LM head by decode_gemm=" + mode + ", the rest FP8 (above)"
        if mode == "torch":
            return "decode GEMMs F.linear"
        if self.device.type != "cuda":
            return f"decode GEMMs {mode}: F.linear (no CUDA device)"
        shapes = self._layer_gemms(lm_head=True)
        if mode == "skinny":
            one_row = f" (one row: {gemv.describe_one_row(shapes)})" if gemv.measured_table() else ""
            return f"decode GEMMs skinny (Triton, <= {SKINNY_MAX_M} rows; F.linear above){one_row}: " + ", ".join(
                g[0] for g in shapes
            )
        return f"decode GEMMs auto (measured table) at {describe_auto(shapes)}"

    # --- the worker: one runner, one KV cache, one attention backend (built on first use) ---------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len or self.config.max_position_embeddings

    @property
    def worker(self):
        """This rank's ModelRunner over its paged KV cache (collective over every rank: the pool size)."""
        if self._worker is None:
            self._worker = self._build_worker()
        return self._worker

    def _build_worker(self):
        from spanllm.attention.backend import resolve_backend
        from spanllm.attention.cascade import cascade_gather_bytes
        from spanllm.engine.worker.kv_cache import (
            CacheSizing,
            PagedKVCache,
            activation_reserve_bytes,
            bytes_per_block,
            size_pool,
        )
        from spanllm.engine.worker.model_runner import ModelRunner

        e, cfg = self.engine, self.config
        max_model_len = self.max_model_len
        if max_model_len > cfg.max_position_embeddings and os.environ.get(ALLOW_LONG_CONTEXT_ENV, "") in ("", "0"):
            raise UsageError(
                f"max_model_len={max_model_len} exceeds the {cfg.max_position_embeddings} positions "
                f"{cfg.label} was trained for (max_position_embeddings); lower it, or set "
                f"{ALLOW_LONG_CONTEXT_ENV}=1 to allow it anyway"
            )
        qkv = next(iter(self.model.model.layers.values())).self_attn.qkv_proj
        backend = resolve_backend(
            e.attention_backend,
            qkv.num_heads_local,
            qkv.num_kv_heads_local,
            cfg.head_dim,
            self.device,
            e.prefill_tiling,
            e.prefill_attention,
            e.cascade_min_prefix,
            e.shared_prefix_attention,
            e.block_size,
            dtype=e.dtype,
            num_layers=len(self.model.layer_ids),
        )
        per_block = bytes_per_block(
            len(self.model.layer_ids), e.block_size, qkv.num_kv_heads_local, cfg.head_dim, e.kv_dtype
        )
        ffn_local = cfg.intermediate_size // self.dims.tp
        reserve = activation_reserve_bytes(
            e.max_num_batched_tokens,
            e.max_num_seqs,
            cfg.hidden_size,
            qkv.weight.shape[0],
            ffn_local,
            cfg.vocab_size,
            e.dtype,
        )
        if e.cuda_graphs and self.device.type == "cuda":  # the graphs' shared float32 logits buffer
            reserve += e.max_num_seqs * cfg.vocab_size * 4
        if getattr(backend, "cascade", None) is not None:  # a chunk's gathered prefix K/V, at the longest prompt
            # (its rounded shape's padding rows and the gather's last whole block on top)
            rows = max_model_len + backend.cascade_bucket + e.block_size
            reserve += cascade_gather_bytes(rows, qkv.num_kv_heads_local, cfg.head_dim, e.dtype, e.kv_dtype.itemsize)
        if self.device.type == "cuda":
            # blocks the build freed (a weight replaced by its FP8 quantization) would count as used below
            torch.cuda.empty_cache()
        sizing = size_pool(
            device=self.device,
            per_block=per_block,
            block_size=e.block_size,
            gpu_memory_utilization=e.gpu_memory_utilization,
            cpu_kv_cache_bytes=e.cpu_kv_cache_bytes,
            reserve_bytes=reserve,
            num_kv_blocks=e.num_kv_blocks,
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            # every rank uses the smallest pool (memory can differ per GPU): the plans' block ids are shared
            n = torch.tensor([sizing.num_blocks], dtype=torch.int64, device=self.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN)
            if int(n) != sizing.num_blocks:
                sizing = CacheSizing(int(n), sizing.block_size, sizing.bytes_per_block, sizing.how + ", min over ranks")
        self.kv_sizing = sizing = replace(sizing, dtype=e.kv_dtype)
        cache = PagedKVCache(
            list(self.model.layer_ids),
            sizing.num_blocks,
            e.block_size,
            qkv.num_kv_heads_local,
            cfg.head_dim,
            self.device,
            e.kv_dtype,
        )
        return ModelRunner(
            self.model,
            cache,
            backend,
            max_num_seqs=e.max_num_seqs,
            max_model_len=max_model_len,
            cuda_graphs=e.cuda_graphs,
            device=self.device,
            dtype=e.dtype,
            max_num_batched_tokens=e.max_num_batched_tokens,
        )

    # --- the serving engine --------------------------------------------------------------------------
    @property
    def engine_core(self):
        """The continuous-batching engine (built on first use; collective over the TP group)."""
        if self._engine_core is None:
            self._engine_core = self._build_engine_core()
        return self._engine_core

    def _build_engine_core(self):
        from spanllm.engine.core.block_manager import BlockManager
        from spanllm.engine.core.scheduler import SchedulerConfig
        from spanllm.engine.engine_core import EngineCore

        if self.dims.pp != 1:
            raise UsageError(
                f"the serving engine runs pp=1 (tensor parallelism only); this LLM has {self.dims}. "
                "Fixed batches run at any pipeline depth (generate_batch, bench batch / study)"
            )
        runner = self.worker
        e, cfg = self.engine, self.config
        if self.dims.tp > 1:
            self._control_group = (
                self.groups.tp_group
                if dist.get_backend(self.groups.tp_group) == "gloo"
                else dist.new_group(dist.get_process_group_ranks(self.groups.tp_group), backend="gloo")
            )
        blocks = BlockManager(runner.cache.num_blocks, e.block_size, e.enable_prefix_caching)
        sched = SchedulerConfig(
            e.max_num_seqs,
            e.max_num_batched_tokens,
            self.max_model_len,
            min_admit=e.min_admit,
            long_prefill_attention_budget=e.long_prefill_attention_budget,
            scheduling_policy=e.scheduling_policy,
            prefill_tokens_beside_decodes=self.prefill_tokens_beside_decodes,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
        )
        eos = cfg.eos_token_ids or (self.tokenizer.eos_token_ids if self.tokenizer is not None else ())
        return EngineCore(
            runner,
            blocks,
            sched,
            vocab_size=cfg.vocab_size,
            eos_token_ids=eos,
            tokenizer=self.tokenizer,
            seed=e.seed,
            control_group=self._control_group,
            rank=self.groups.tp_rank,
            tp_size=self.dims.tp,
            async_scheduling=e.async_scheduling,
        )

    # --- fixed batches ---------------------------------------------------------------------------------
    def generate_batch(
        self,
        prompts: list[list[int]],
        params: SamplingParams | None = None,
        micro_batches: int = 1,
        keep_logits: bool = False,
    ) -> GenerationOutput:
        """One fixed batch of `prompts` (lists of token ids) on every pipeline stage: the study's workload
        (`bench batch`, `bench study`). Every decode step runs the whole batch (each micro-batch): max_num_seqs does
        not split it (the `generate` command refuses a batch wider than its --max-num-seqs); max_num_batched_tokens
        cuts the prefill into steps. Every rank returns the same tokens. Sampling: temperature, top-k / top-p,
        max_tokens and ignore_eos; the rest of SamplingParams is the serving engine's (`generate`)."""
        from spanllm.engine.engine_core import token_ids, validate_request

        self._check_open("generate_batch")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise UsageError(
                f"params={params!r} ({type(params).__name__}) is not a SamplingParams: generate_batch samples the "
                "whole batch alike; pass one SamplingParams (LLM.generate takes one per prompt)"
            )
        batch = [] if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__iter__") else list(prompts)
        if not batch:
            raise UsageError(
                f"prompts={prompts!r}: generate_batch takes a non-empty list of prompts, each a list of token ids"
            )
        prompts = batch
        for i, ids in enumerate(prompts):
            if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
                raise UsageError(
                    f"prompt {i} is {ids!r} ({type(ids).__name__}), not a list of token ids: generate_batch takes "
                    "token ids (LLM.generate takes text)"
                )
        prompts = [token_ids(ids) for ids in prompts]  # numpy / torch integer ids as Python ints
        unsupported = [
            n
            for n, v in (
                ("seed", params.seed is not None),
                ("min_tokens", params.min_tokens > 0),
                ("stop", bool(params.stop)),
                ("stop_token_ids", bool(params.stop_token_ids)),
                ("presence_penalty", params.presence_penalty != 0.0),
                ("frequency_penalty", params.frequency_penalty != 0.0),
                ("repetition_penalty", params.repetition_penalty != 1.0),
                ("min_p", params.min_p > 0.0),
                ("logit_bias", bool(params.logit_bias)),
                ("logprobs", params.logprobs is not None),
                ("n", params.n != 1),
            )
            if v
        ]
        if unsupported:
            raise UsageError(
                f"generate_batch takes temperature, top_k, top_p, max_tokens and ignore_eos; "
                f"{', '.join(unsupported)} need the serving engine (LLM.generate)"
            )
        runner = self.worker
        for ids in prompts:
            validate_request(
                ids,
                params,
                vocab_size=self.config.vocab_size,
                max_model_len=self.max_model_len,
                capacity_tokens=(runner.cache.num_blocks - 1) * runner.block_size,
            )
        self._ran_fixed_batch = True
        executor = FixedBatchExecutor(
            runner,
            self.groups,
            BatchSampler(self.device, self.engine.seed),
            self.timers,
            self._token_group,
            self.engine.max_num_batched_tokens,
        )
        return executor.generate(prompts, params, micro_batches, self.config.eos_token_ids, keep_logits)

    def get_tokenizer(self, loaded=None):
        """The model's tokenizer (checkpoint folder, or Llama 3's for the llama3 presets), loaded once; `loaded`:
        one the caller already has for this model (spanllm.engine.tokenizer.get_tokenizer's)."""
        if self.tokenizer is None:
            from spanllm.engine.tokenizer import get_tokenizer

            self.tokenizer = loaded or get_tokenizer(self.config.name, self.config.checkpoint_dir)
            if self._engine_core is not None:
                self._engine_core.tokenizer = self.tokenizer
                if not self._engine_core.eos_token_ids:  # config.json named no EOS: the tokenizer's
                    self._engine_core.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        return self.tokenizer

    def chat(self, messages, params=None, on_output=None, *, sampling_params=None, use_tqdm=False) -> list:
        """vLLM's LLM.chat: `messages` is one conversation (a list of {"role", "content"} dicts; roles system, user,
        assistant) or a list of conversations. Each goes through the model's chat template (its tokenizer's, which
        ends it with the assistant's turn) and is served as `generate` serves token ids; returns one RequestOutput
        per conversation, its `text` the answer. params (or sampling_params), on_output and use_tqdm: as generate's.
        Collective, as generate."""
        from spanllm.engine.tokenizer import TokenizerError

        params = _one_params(params, sampling_params)
        one = isinstance(messages, list) and bool(messages) and all(isinstance(m, dict) for m in messages)
        convs = [messages] if one else messages
        if not isinstance(convs, (list, tuple)) or not convs:
            raise UsageError(
                f"messages={messages!r}: give one conversation (a list of {{'role', 'content'}} dicts) or a "
                "non-empty list of them"
            )
        tok = self.get_tokenizer()
        prompts = []
        for i, conv in enumerate(convs):
            try:
                prompts.append(tok.apply_chat_template(list(conv) if isinstance(conv, tuple) else conv))
            except TokenizerError as e:
                raise UsageError(f"conversation {i}: {e}") from None
        return self.generate(prompts, params, on_output, use_tqdm=use_tqdm)

    def generate(self, prompts, params=None, on_output=None, *, sampling_params=None, use_tqdm=False) -> list:
        """Serve `prompts` to completion on the serving engine; returns one RequestOutput per prompt, in order. A
        prompt is a string, a list of token ids (Python, numpy or torch integers), or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}; `prompts` is one prompt (a string, a list of ints: vLLM's rule) or a list of
        them. `params` (or `sampling_params`, vLLM's name): one SamplingParams for every prompt, or a list of one
        per prompt. Collective: call it on every TP rank (rank 0 schedules and returns the outputs; the others run
        the step plans it sends and return []). `on_output(out)`, if given, is called on rank 0 with every
        RequestOutput of every step as it lands (new tokens, `finished`): a progress bar's hook; it runs inside the
        engine loop, so keep it cheap.
        `use_tqdm` (vLLM's name): a progress bar of finished requests and output tok/s on stderr, where that is a
        terminal (spanllm.engine.progress, drawn by rich). Every prompt and parameter is checked before any request
        is admitted."""
        from spanllm.engine.engine_core import RequestError
        from spanllm.engine.progress import RequestProgress
        from spanllm.engine.prompts import params_list, prompt_list, prompt_of

        params = _one_params(params, sampling_params)
        self._check_open("generate")
        if self._generating:  # its steps would take the outer call's outputs, which then returned None for them
            raise UsageError(
                "generate was called inside generate (from on_output): the engine is serving that call; collect "
                "what on_output sees and call generate again once it has returned"
            )
        core = self.engine_core
        if core.rank != 0:
            core.worker_loop()
            return []
        self._generating = True
        try:  # whatever rank 0 refuses, the finally releases the other ranks' worker loops
            prompts = prompt_list(prompts)
            plist = params_list(params, len(prompts))
            if on_output is not None and not callable(on_output):
                raise UsageError(
                    f"on_output={on_output!r} ({type(on_output).__name__}) is not callable: give a function of one "
                    "RequestOutput, or None"
                )
            if not isinstance(use_tqdm, bool):
                raise UsageError(f"use_tqdm={use_tqdm!r} ({type(use_tqdm).__name__}): give True or False")
            ids_list, texts = [], []
            for i, p in enumerate(prompts):
                p = prompt_of(i, p)
                if isinstance(p, str):
                    ids_list.append(self.get_tokenizer().encode(p))
                    texts.append(True)
                else:
                    ids_list.append(p)
                    texts.append(self.tokenizer is not None)
            # n > 1: sample j of a prompt is an engine request of its own, seeded seed_for_sample(seed, j)
            samples = [[_sample_params(sp, j) for j in range(sp.n)] for sp in plist]
            for i, (ids, sps, t) in enumerate(zip(ids_list, samples, texts)):
                sp = sps[0]
                try:  # all or nothing: nothing is admitted before every request is checked
                    core.validate(ids, sp)
                except RequestError as e:
                    raise RequestError(f"prompt {i}: {e}") from None
                if sp.stop and not t:
                    raise RequestError(
                        f"prompt {i}: stop strings need text output; give a text prompt or load the "
                        "tokenizer first (get_tokenizer), or use stop_token_ids"
                    )
            ids_of: dict[str, tuple[int, int]] = {}  # engine request -> (prompt, sample)
            results: list[list] = [[None] * len(sps) for sps in samples]
            bar = RequestProgress(sum(map(len, samples)), "generate") if use_tqdm else None
            hooks = [h for h in (bar and bar.on_output, on_output) if h]  # the bar's hook is None off a terminal
            try:
                for i, (ids, sps, t) in enumerate(zip(ids_list, samples, texts)):
                    for j, sp in enumerate(sps):
                        seq = core.add_request(ids, sp, with_text=t)
                        ids_of[seq.request_id] = (i, j)
                with bar or contextlib.nullcontext():
                    while core.has_unfinished():
                        for out in core.step():
                            for hook in hooks:
                                hook(out)
                            if out.finished and out.request_id in ids_of:
                                i, j = ids_of[out.request_id]
                                results[i][j] = out
            except BaseException:
                for rid in ids_of:  # nothing of this call stays queued for the next one
                    core.abort_request(rid)
                raise
            return [outs[0] if len(outs) == 1 else replace(outs[0], samples=outs) for outs in results]
        finally:
            self._generating = False
            core.shutdown_workers()

    @contextlib.contextmanager
    def timed_ops(self):
        """Per-op timers on for the runs inside (bench batch's decode breakdown): hooks attached to the model,
        every step eager (events can only be placed in eager code). Collective use: every rank."""
        runner = self.worker
        detach = self.timers.attach(self.model)
        graphs, runner.use_cuda_graphs = runner.use_cuda_graphs, False
        self.timers.enabled = True
        try:
            yield self.timers
        finally:
            self.timers.enabled = False
            runner.use_cuda_graphs = graphs
            detach()

    def close(self) -> None:
        """Drop CUDA graphs (they hold the communicator's captured calls), then close an owned communicator. Nothing
        runs on this LLM afterwards (generate, generate_batch and scoring refuse); a second close does nothing."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.reset_graphs()
        self._close_comm()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise UsageError(
                f"{what} on a closed LLM: close() released its communicator and CUDA graphs; build a new LLM"
            )


def _sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """Sample j of a prompt's `params` (n samples): one engine request, n = 1, seeded seed_for_sample(seed, j)."""
    if params.n == 1:
        return params
    # a copy by its fields (dataclasses.replace), not of the sampler's cached properties
    seed = None if params.seed is None else seed_for_sample(params.seed, j)
    return replace(params, n=1, seed=seed)


def _one_params(params, sampling_params):
    """generate's and chat's sampling parameters, given by our name or vLLM's (not both)."""
    if params is not None and sampling_params is not None:
        raise UsageError("params and sampling_params are the same argument (vLLM's name and ours): give one of them")
    return params if sampling_params is None else sampling_params
