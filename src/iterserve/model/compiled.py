"""The layer stack compiled once, then called without TorchDynamo's per-call guard checks.

torch.compile guards every call: it re-checks each input tensor's dtype, shape and strides,
and that none of some 400 tensors (weights, K/V caches) alias, before it runs a graph. For
a one-token decode step that check cost ~1-1.5 ms of a ~10 ms step (torch.profiler's
"TorchDynamo Cache Lookup", one profile, no script). Nothing it checks can change between steps of one engine: the
weights and caches are fixed tensors, and the only shape that varies, the step's token
count, is what picks between the two graphs (one token, or a dynamic count). So once both
graphs exist, `freeze` takes dynamo's compiled bytecode for each and later calls go straight
to it, choosing by token count: the CPU analogue of replaying a captured CUDA graph.
vLLM's compiled models dispatch the same way.

Skipping the guards is sound only for what the graphs take as inputs of any length: a tensor
the graph reads as a module attribute is a constant of the trace, and a tensor argument whose
length was not marked dynamic is specialized to the length first seen. So whatever may grow
between steps (the packed sequence table, the rotary tables) is an argument marked dynamic.
"""

from __future__ import annotations

import gc
import types
from collections.abc import Callable
from typing import Any

import torch

from iterserve.model.host_memory import release_freed_memory


class CompiledLayers:
    """Call `method` (a bound method) compiled; after `freeze`, without guards."""

    def __init__(
        self,
        method: Callable[..., torch.Tensor],
        dynamic_args: tuple[int, ...],
        kv_caches_arg: int | None = None,
    ) -> None:
        """`dynamic_args`: the indices of the arguments (tensors, None, or tuples of tensors)
        whose first dimension varies independently of the token count (it is marked dynamic
        before the graph is traced). `kv_caches_arg`: the index of the argument holding the
        layers' (K, V) pools, [kv_heads, num_blocks, block_size, width] each, when the graph
        takes them as inputs (the C++ attention op): their block count is marked dynamic
        too. `--kv-cache-memory auto` sizes the pool by the memory free at start-up, so it
        differs from one start to the next, and a graph specialized to it missed
        inductor's on-disk cache every time: Gemma 4 E2B compiled afresh at each start,
        165-222 s, and loads in 40 s from the cache once the count is dynamic (AVX2 Zen 3,
        2026-12-04; the two starts' cache keys, in torch._inductor.codecache's debug log,
        differed only in the pools' block count)."""
        self._method = method
        self._owner = method.__self__  # type: ignore[attr-defined]
        self._code = method.__func__.__code__  # type: ignore[attr-defined]
        self._dynamic_args = dynamic_args
        self._kv_caches_arg = kv_caches_arg
        # Dynamo keeps its graphs per code object, so every model in a process (tests,
        # benchmarks comparing paths) adds its two to the same cache.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._compiled = torch.compile(method, fullgraph=True)
        self._direct: dict[bool, types.FunctionType] = {}  # one token? -> compiled bytecode
        self._samples: dict[bool, tuple[Any, ...]] = {}  # the last arguments of each kind

    @property
    def frozen(self) -> bool:
        return bool(self._direct)

    def __call__(self, *args: Any) -> torch.Tensor:
        if self._direct:
            return self._direct[args[0].shape[0] == 1](self._owner, *args)
        for index in self._dynamic_args:
            marked = args[index]
            for tensor in marked if isinstance(marked, tuple) else (marked,):
                if tensor is not None:
                    torch._dynamo.maybe_mark_dynamic(tensor, 0)
        if self._kv_caches_arg is not None:
            for pair in args[self._kv_caches_arg]:
                for pool in pair:
                    torch._dynamo.maybe_mark_dynamic(pool, 1)
        self._samples[args[0].shape[0] == 1] = args
        return self._compiled(*args)

    def freeze(self) -> None:
        """Bind each shape class to its compiled bytecode, found by running dynamo's own guards
        once on the last arguments of that class it saw (so call both kinds first)."""
        if set(self._samples) != {True, False}:
            raise RuntimeError("freeze() needs a one-token and a many-token call first")
        names = self._code.co_varnames[: self._code.co_argcount]
        entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(self._code)
        for key, sample in self._samples.items():
            frame = dict(zip(names, (self._owner, *sample), strict=True))
            with torch.inference_mode():  # global state is guarded too; steps run in this mode
                entry = next((e for e in entries if e.guard_manager.check(frame)), None)
            if entry is None:
                raise RuntimeError("no compiled graph accepts the sample step; warm up first")
            globals_ = self._method.__func__.__globals__  # type: ignore[attr-defined]
            self._direct[key] = types.FunctionType(entry.code, globals_, self._code.co_name)
        self._samples.clear()
        # Compiling leaves cycles and freed C heap behind: 20-50 MB of Gemma 4 E2B's held
        # RSS, collected and given back here (measured once, warm and cold compile caches).
        gc.collect()
        release_freed_memory()
