"""LLM: the engine's entry point. Builds the stage of the model this rank runs, its weights, its KV
cache and its communicator, then generates.

    llm = LLM("llama3.1-8b", EngineConfig(max_batch_size=8, max_seq_len=1024), allreduce="nccl")
    out = llm.generate_static([[1, 2, 3]], SamplingParams(max_tokens=16))

Run it on every rank of a job (torchrun, or `spanllm.launch.launch` on CPU). The all-reduce is
injected: pass `comm=` (any object with `all_reduce_(x)`) or `allreduce=` (a name registered in
`spanllm.comm`); `allreduce_ran(batch)` names the algorithm that runs for a decode step of that batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spanllm.comm.topology import Topology
from spanllm.engine.config import EngineConfig, ModelConfig, resolve_model
from spanllm.engine.layers import Communicator, TPContext
from spanllm.engine.loader import load_checkpoint, random_init
from spanllm.engine.model import LlamaForCausalLM
from spanllm.engine.model_runner import ModelRunner
from spanllm.engine.parallel_dims import ParallelDims, build_groups, stage_layers
from spanllm.engine.pipeline import GenerationOutput, PipelineExecutor, build_token_groups
from spanllm.engine.sampler import Sampler, SamplingParams
from spanllm.engine.timers import Timers


def default_device() -> torch.device:
    """cuda:LOCAL device when this process's group runs NCCL (or no group and a GPU), else CPU."""
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_allreduce(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class LLM:
    def __init__(self, model: str | ModelConfig, engine: EngineConfig | None = None, *,
                 dims: ParallelDims | None = None, allreduce: str | None = None, comm: Communicator | None = None,
                 device: torch.device | None = None, ranks_per_node: int | None = None, tuning=None) -> None:
        self.config = resolve_model(model) if isinstance(model, str) else model
        self.engine = engine or EngineConfig()
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
            token_group = build_token_groups(self.groups)
        else:
            from spanllm.engine.parallel_dims import ParallelGroups
            self.groups, token_group = ParallelGroups(self.dims, 0, None), None

        self._owns_comm = False
        if comm is not None and allreduce is not None:
            raise ValueError("pass either comm= (an object) or allreduce= (a registered name), not both")
        if comm is None and self.dims.tp > 1:
            allreduce = allreduce or default_allreduce(self.device)
            comm = self._create_comm(allreduce)
            self._owns_comm = True
        self.comm = comm
        self.large_comm = None
        self._ensure_large_comm(comm)

        self.timers = Timers(self.device, enabled=self.engine.breakdown, layer_spins=self.dims.pp == 1)
        self._check_decode_gemm()
        tp = TPContext(rank=self.groups.tp_rank, size=self.dims.tp, group=self.groups.tp_group, comm=comm,
                       large_comm=self.large_comm, decode_gemm=self.engine.decode_gemm,
                       timers=self.timers, device=self.device, dtype=self.engine.dtype)
        g = self.groups
        layers = stage_layers(self.config.num_layers, self.dims.pp, g.stage)
        self.model = LlamaForCausalLM(self.config, tp, layers, g.is_first_stage, g.is_last_stage)
        self._op_handles: list[str] = []
        self._register_ops()
        if self.config.checkpoint_dir is not None:
            load_checkpoint(self.model, self.config.checkpoint_dir)
        else:
            random_init(self.model, self.engine.seed, self.rank)
        self.runner = ModelRunner(self.model, self.engine, self.device)
        self.sampler = Sampler(self.device, self.engine.seed)
        self.executor = PipelineExecutor(self.runner, g, self.sampler, self.timers, token_group)

    def _check_decode_gemm(self) -> None:
        """decode_gemm="skinny" runs a Triton kernel: refuse a machine without a GPU or Triton, no fallback."""
        if self.engine.decode_gemm != "skinny":
            return
        from spanllm.engine import skinny_gemm
        if self.device.type != "cuda" or skinny_gemm.triton is None:
            raise ValueError(f"decode_gemm='skinny' needs a CUDA device and Triton; this rank has device "
                             f"{self.device} and Triton {'installed' if skinny_gemm.triton else 'missing'}. "
                             "Use decode_gemm='torch' (F.linear) here")
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
        return self.model.tp.comm_for(x).algorithm_for(x) if self.large_comm is not None else probe(x)

    def allreduce_ran_prefill(self, batch: int, prompt_len: int) -> str:
        """The algorithm that reduces a prefill all-reduce ([batch, prompt_len, hidden])."""
        if self.dims.tp == 1:
            return "none"
        x = torch.empty(batch, prompt_len, self.config.hidden_size, dtype=self.engine.dtype, device=self.device)
        comm = self.model.tp.comm_for(x)
        probe = getattr(comm, "algorithm_for", None)
        return probe(x) if probe is not None else getattr(comm, "name", type(comm).__name__)

    def _create_comm(self, name: str) -> Communicator:
        """A registered all-reduce on this rank's TP group (collective over the group)."""
        from spanllm.comm import create

        comm = create(name, group=self.groups.tp_group, topology=self.dims.tp_topology(self.topology),
                      device=self.device, tuning=self.tuning, max_bytes=self.engine.allreduce_max_bytes)
        if self.device.type == "cuda":  # nvrar's kernels for every size it may see, compiled in parallel now
            from spanllm.comm.nvrar_compile import precompile_sizes, size_ladder

            precompile_sizes([comm], size_ladder(self.engine.allreduce_max_bytes // self.engine.dtype.itemsize),
                             [self.engine.dtype])
        return comm

    def _ensure_large_comm(self, comm: Communicator | None) -> None:
        """A buffered backend (nvrar, torch symm-mem) takes decode-sized messages; larger ones (prefill)
        go to the group's own collective, as in the paper's engine. allreduce_ran_prefill() names it."""
        if self.dims.tp > 1 and self.large_comm is None and getattr(comm, "max_bytes", None) is not None:
            self.large_comm = self._create_comm(default_allreduce(self.device))

    def use_allreduce(self, name: str | None = None, comm: Communicator | None = None) -> None:
        """Swap the communicator the row-parallel layers call (by registered name, or an object), keeping
        weights and KV cache. Collective when it creates one. Captured decode graphs are dropped."""
        if self.dims.tp == 1:
            return
        if (name is None) == (comm is None):
            raise ValueError("pass exactly one of name= or comm=")
        if name is not None:
            comm = self._create_comm(name)
        self._unregister_ops()  # before the old communicator closes
        if self._owns_comm and self.comm is not None:
            self.comm.close()
        self._owns_comm = name is not None
        self.comm = comm
        self._ensure_large_comm(comm)
        self.model.tp.comm = comm
        self.model.tp.large_comm = self.large_comm
        self._register_ops()  # compiled code guards on the handle: the next decode recompiles
        self.runner.reset_graphs()

    def _register_ops(self) -> None:
        """compile_decode: register comm (and large_comm) for torch.ops.spanllm.all_reduce_ and hand the
        handles to the row-parallel layers (callers have dropped any previous registration)."""
        if not self.engine.compile_decode or self.dims.tp == 1:
            return
        from spanllm.comm import op

        tp = self.model.tp
        tp.comm_handle = op.register(self.comm)
        self._op_handles.append(tp.comm_handle)
        if self.large_comm is not None:
            tp.large_comm_handle = op.register(self.large_comm)
            self._op_handles.append(tp.large_comm_handle)

    def _unregister_ops(self) -> None:
        if not self._op_handles:
            return
        from spanllm.comm import op

        for h in self._op_handles:
            op.unregister(h)
        self._op_handles.clear()
        self.model.tp.comm_handle = self.model.tp.large_comm_handle = None

    @property
    def cuda_graphs(self) -> bool:
        return self.runner.use_cuda_graphs

    def describe(self) -> str:
        graphs = "on" if self.cuda_graphs else (
            "off (breakdown timers need eager decode)" if self.runner.graphs_allowed else "off")
        return (f"{self.config.label} | {self.dims} | stage {self.groups.stage} layers "
                f"[{self.model.layer_ids.start}, {self.model.layer_ids.stop}) | {self.engine.dtype} on "
                f"{self.device} | all-reduce {self.allreduce_name} | CUDA graphs {graphs}"
                + (f" | compiled decode ({self.engine.compile_backend}, {self.engine.compile_scope})"
                   if self.engine.compile_decode else "")
                + (" | decode GEMMs skinny (Triton, <= 16 rows; F.linear above)"
                   if self.engine.decode_gemm == "skinny" else ""))

    # --- generation -----------------------------------------------------------------------------------
    def generate_static(self, prompts: list[list[int]], params: SamplingParams | None = None,
                        micro_batches: int | None = None, keep_logits: bool = False) -> GenerationOutput:
        """The static-batch fast path (`bench batch`, `bench study`): prefill and decode for `prompts`
        (lists of token ids) as one fixed batch on every rank, any pipeline depth; every rank returns the
        same tokens. micro_batches overrides EngineConfig.micro_batches (pipeline schedule)."""
        params = params or SamplingParams()
        m = self.engine.micro_batches if micro_batches is None else micro_batches
        return self.executor.generate(prompts, params, m, self.config.eos_token_ids, keep_logits)

    def close(self) -> None:
        """Drop decode graphs (they hold the communicator's captured calls), then close an owned communicator."""
        self.runner.reset_graphs()
        self._unregister_ops()
        if self._owns_comm and self.comm is not None:
            self.comm.close()
        self.comm = None
        if self.large_comm is not None:
            self.large_comm.close()
            self.large_comm = None
