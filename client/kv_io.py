"""KV inputs and outputs of the engine: the accepted forms, masks, and the fastest copies.

Why this file exists: callers hand KV over in several forms (one blob tensor, a tuple of
per-layer (K, V), a transformers DynamicCache) and in two orders (vllm: token-major,
huggingface: head-major). `KVSource` turns any of them into views in the layout's own
order without copying; `copy_tensor` moves bytes with the fastest routine measured here
(numpy `copyto`, faster on one thread than a single-thread torch copy:
docs/architecture.md, "Performance rules"); `new_kv_buffer` allocates results with numpy, which
applies MADV_HUGEPAGE to large arrays (~5 GB/s first touch against ~2 GB/s for
`torch.empty`).
"""

import functools
from typing import Callable

import numpy as np
import torch

from lmcached.client.layout import KVLayout


def suffix_mask_skip(mask, num_tokens: int, chunk_size: int | None = None) -> int:
    """Leading tokens a suffix mask leaves out (the seed's `mask` of store / retrieve).

    Args:
        mask: None, or bool `[num_tokens]` (tensor, array or list): False for the
            skipped tokens, then True.
        num_tokens: the request's length.
        chunk_size: if given, the skip must be a multiple of it (whole chunks, as the
            seed's store asserts); None: any count (a retrieve).

    Returns:
        The number of leading False entries (0 for no mask).

    Raises:
        ValueError: a mask of another shape, not a suffix mask, or not chunk aligned.
    """
    if mask is None:
        return 0
    mask = np.asarray(mask.cpu() if isinstance(mask, torch.Tensor) else mask, dtype=bool)
    if mask.shape != (num_tokens,):
        raise ValueError(f"mask has shape {mask.shape}, tokens have ({num_tokens},)")
    skip = num_tokens - int(mask.sum())
    if mask[:skip].any() or not mask[skip:].all():
        raise ValueError("mask must be a suffix mask: False for skipped tokens, then True")
    if chunk_size is not None and skip % chunk_size:
        raise ValueError(
            f"mask skips {skip} tokens, not a multiple of chunk_size {chunk_size}"
            " (a store mask must skip whole chunks)"
        )
    return skip


def is_dynamic_cache(kv) -> bool:
    """True for a transformers Cache of per-layer K/V (duck-typed: no import needed)."""
    return hasattr(kv, "layers") or (hasattr(kv, "key_cache") and hasattr(kv, "value_cache"))


def dynamic_cache_layers(kv) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K, V) per layer of a DynamicCache, each `[batch, num_kv_heads, num_tokens, head_size]`.

    Raises:
        ValueError: a layer is not a plain K/V layer (e.g. a sliding-window or
            linear-attention state), or is empty.
    """
    if hasattr(kv, "layers"):
        pairs = []
        for i, layer in enumerate(kv.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise ValueError(
                    f"cache layer {i} ({type(layer).__name__}) has no K/V tensors: only "
                    "caches of full per-layer K/V (DynamicCache) can be stored"
                )
            pairs.append((keys, values))
        return pairs
    return list(zip(kv.key_cache, kv.value_cache))


class KVSource:
    """A request's KV as views in the layout's order, chunk by chunk (no copies).

    Accepted `kv` forms (T = tokens the KV covers):
        - blob tensor: `[num_layers, 2, T, num_kv_heads, head_size]` (fmt vllm) or
          `[num_layers, 2, num_kv_heads, T, head_size]` (fmt huggingface);
        - tuple/list of num_layers `(K, V)`, each `[T, num_kv_heads, head_size]` (vllm) or
          `[num_kv_heads, T, head_size]` (huggingface), optionally with a leading batch
          dimension of 1;
        - a transformers DynamicCache of batch 1 (`[1, num_kv_heads, T, head_size]` per
          layer), whatever the layout's fmt.

    Raises:
        ValueError: a shape or dtype that does not match the layout (the message gives
            the expected and actual shapes), or a batch other than 1.
        TypeError: an unsupported kv type.
    """

    def __init__(self, kv, layout: KVLayout) -> None:
        self.layout = layout
        self.blob: torch.Tensor | None = None
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if isinstance(kv, torch.Tensor):
            self._init_blob(kv)
        elif is_dynamic_cache(kv):
            self._init_layers(dynamic_cache_layers(kv), "huggingface")
        elif isinstance(kv, (tuple, list)):
            self._init_layers(list(kv), layout.fmt)
        else:
            raise TypeError(
                f"kv must be a tensor, a tuple of per-layer (K, V) or a DynamicCache, got {type(kv)}"
            )

    def _check_dtype(self, tensor: torch.Tensor) -> None:
        if tensor.dtype != self.layout.torch_dtype:
            raise ValueError(f"KV dtype is {tensor.dtype}, the layout says {self.layout.dtype}")

    def _init_blob(self, blob: torch.Tensor) -> None:
        layout = self.layout
        self._check_dtype(blob)
        self.num_tokens = blob.shape[layout.token_dim] if blob.dim() == 5 else -1
        if blob.dim() != 5 or tuple(blob.shape) != layout.chunk_shape(self.num_tokens):
            raise ValueError(
                f"KV blob of shape {tuple(blob.shape)} does not match the {layout.fmt} layout "
                f"{layout.chunk_shape('T')}"
            )
        self.blob = blob

    def _init_layers(self, pairs: list, source_fmt: str) -> None:
        layout = self.layout
        if len(pairs) != layout.num_layers:
            raise ValueError(f"KV has {len(pairs)} layers, the layout has {layout.num_layers}")
        layers = []
        for i, pair in enumerate(pairs):
            if len(pair) != 2:
                raise ValueError(f"layer {i} must be a (K, V) pair, got {len(pair)} tensors")
            kv = []
            for tensor in pair:
                if tensor.dim() == 4:
                    if tensor.shape[0] != 1:
                        raise ValueError(f"layer {i}: batch {tensor.shape[0]}; only batch 1 is stored")
                    tensor = tensor[0]
                self._check_dtype(tensor)
                if source_fmt != layout.fmt:
                    tensor = tensor.transpose(0, 1)  # a view: [H, T, D] <-> [T, H, D]
                kv.append(tensor)
            layers.append(tuple(kv))
        token_dim = 0 if layout.fmt == "vllm" else 1
        self.num_tokens = layers[0][0].shape[token_dim]
        expected = layout.chunk_shape(self.num_tokens)[2:]
        for i, (k, v) in enumerate(layers):
            if tuple(k.shape) != expected or tuple(v.shape) != expected:
                raise ValueError(
                    f"layer {i}: K {tuple(k.shape)} / V {tuple(v.shape)} do not match the "
                    f"{layout.fmt} layout {expected}"
                )
        self.layers = layers

    @property
    def any_tensor(self) -> torch.Tensor:
        """One of the source tensors (its device is the source's device)."""
        return self.blob if self.blob is not None else self.layers[0][0]

    def copy_chunk(self, start: int, end: int, dst: torch.Tensor) -> None:
        """Copy tokens [start, end) into `dst`, a contiguous `layout.chunk_shape(end-start)`."""
        if self.blob is not None:
            index = [slice(None)] * 5
            index[self.layout.token_dim] = slice(start, end)
            copy_tensor(dst, self.blob[tuple(index)])
            return
        token_dim = 0 if self.layout.fmt == "vllm" else 1
        for layer, (k, v) in enumerate(self.layers):
            copy_tensor(dst[layer, 0], k.narrow(token_dim, start, end - start))
            copy_tensor(dst[layer, 1], v.narrow(token_dim, start, end - start))


def copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for equal shapes and dtypes, any strides.

    CPU tensors go through numpy `copyto` on integer aliases (numpy has no bfloat16),
    which releases the GIL and runs at memory speed; other devices use torch's copy, queued
    without blocking: the caller synchronizes (`cuda.synchronize_if_cuda`) before it
    publishes or releases the bytes.
    """
    if src.device.type == "cpu" and dst.device.type == "cpu":
        alias = _INT_ALIAS[src.dtype.itemsize]
        np.copyto(dst.view(alias).numpy(), src.view(alias).numpy(), casting="no")
    else:
        # Copies may run on ChunkCopier threads, outside the caller's (thread-local)
        # inference mode: enter it when the destination was made under it.
        with torch.inference_mode(dst.is_inference()):
            dst.copy_(src, non_blocking=True)


_INT_ALIAS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def after_caller_stream(*tensors: torch.Tensor | None, cuda=torch.cuda) -> Callable[[], None]:
    """Order copies made on other threads after the work the caller queued on its stream.

    A copy thread copies on its own current CUDA stream (each thread's default), not on
    the stream of the thread that produced the KV: unordered, a copy can read a tensor
    before a kernel queued on the caller's stream has written it (PyTorch's "CUDA
    semantics" note: use of a tensor on another stream needs an explicit order). Call
    this on the caller's thread when the work is submitted: it records an event on the
    caller's current stream of the first CUDA tensor's device. Each copy thread calls the
    returned function before it copies: its current stream on that device then waits for
    the event (`Stream.wait_event`: the device waits, the thread does not block).

    Args:
        tensors: the tensors the copies read or write (None is skipped); CPU tensors
            need no order.
        cuda: the `torch.cuda` module (tests pass a stand-in with `Event`,
            `current_stream(device)` and the stream's `wait_event`).

    Returns:
        A function of no arguments, to call on each copy thread before its copies; it
        does nothing when no tensor is on a CUDA device.
    """
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cuda":
            device = tensor.device
            event = cuda.Event()
            event.record(cuda.current_stream(device))

            def wait() -> None:
                cuda.current_stream(device).wait_event(event)

            return wait
    return _no_order


def _no_order() -> None:
    """`after_caller_stream` of CPU tensors: nothing to wait for."""


def new_kv_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor allocated by numpy (huge pages for large buffers).

    Returns:
        Contiguous tensor of `shape` and `dtype`.
    """
    alias = _INT_ALIAS[dtype.itemsize]
    array = np.empty(shape, dtype=torch.empty((), dtype=alias).numpy().dtype)
    return torch.from_numpy(array).view(dtype)


class ChunkCopier:
    """Runs a request's per-chunk copies on a few threads.

    Measured here: copies of 32 MiB chunks into shared memory run at ~9.4 GB/s on one
    thread and ~13 GB/s on two (numpy releases the GIL while it copies), against ~15.5
    GB/s for one 512 MiB memcpy, which glibc does with non-temporal stores. Two threads
    are the default on these 2-core machines; a busy serving process may want 1.

    Args:
        num_threads: copy threads, >= 1 (1 copies inline on the caller's thread).

    Raises:
        ValueError: num_threads < 1.
    """

    def __init__(self, num_threads: int) -> None:
        if num_threads < 1:
            raise ValueError(f"copy threads must be >= 1, got {num_threads}")
        self.num_threads = num_threads
        self._executor = None

    def run(self, tasks: list) -> None:
        """Call every task (a no-argument callable); re-raise the first failure."""
        if self.num_threads == 1 or len(tasks) < 2:
            for task in tasks:
                task()
            return
        if self._executor is None:
            import concurrent.futures

            self._executor = concurrent.futures.ThreadPoolExecutor(
                self.num_threads, thread_name_prefix="lmcached-copy"
            )
        for future in [self._executor.submit(task) for task in tasks]:
            future.result()

    def close(self) -> None:
        """Stop the threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


class OrderedCopier:
    """A `ChunkCopier` whose tasks each call `order()` first, on the thread that runs
    them (`after_caller_stream`: copies into a caller's CUDA buffer wait for the work
    queued on the caller's stream).

    Args:
        copier: the threads that run the tasks.
        order: called before each task, on its thread.
    """

    def __init__(self, copier: ChunkCopier, order: Callable[[], None]) -> None:
        self.copier = copier
        self.order = order
        self.num_threads = copier.num_threads

    def run(self, tasks: list) -> None:
        """`ChunkCopier.run` of the tasks, each after `order()`."""
        self.copier.run([functools.partial(_after, self.order, task) for task in tasks])


def _after(order: Callable[[], None], task: Callable[[], None]) -> None:
    order()
    task()


def check_out_blob(out: torch.Tensor, layout: KVLayout, num_tokens: int) -> None:
    """Check a caller's `out=` blob for a retrieve of `num_tokens` tokens.

    Raises:
        ValueError: not a 5-d tensor of the layout's chunk shape and dtype, or fewer than
            `num_tokens` tokens long.
    """
    expected = layout.chunk_shape(out.shape[layout.token_dim] if out.dim() == 5 else -1)
    if out.dim() != 5 or tuple(out.shape) != expected or out.dtype != layout.torch_dtype:
        raise ValueError(
            f"out has shape {tuple(out.shape)} {out.dtype}; expected {layout.chunk_shape('T')} "
            f"{layout.torch_dtype}"
        )
    if out.shape[layout.token_dim] < num_tokens:
        raise ValueError(f"out holds {out.shape[layout.token_dim]} tokens, {num_tokens} were found")


def check_out_layers(out, layout: KVLayout, num_tokens: int) -> None:
    """Check a caller's `out=` tuple of per-layer (K, V) for a retrieve of `num_tokens`.

    Raises:
        ValueError: not one pair of 3-d tensors of the layout's dtype per layer, or fewer
            than `num_tokens` tokens long.
    """
    if len(out) != layout.num_layers:
        raise ValueError(f"out has {len(out)} layers, the layout has {layout.num_layers}")
    token_dim = layout.token_dim - 2
    for layer, pair in enumerate(out):
        for tensor in pair:
            if tensor.dtype != layout.torch_dtype or tensor.dim() != 3:
                raise ValueError(f"out layer {layer}: expected 3-d {layout.torch_dtype} tensors")
            if tensor.shape[token_dim] < num_tokens:
                raise ValueError(
                    f"out layer {layer} holds {tensor.shape[token_dim]} tokens, {num_tokens} were found"
                )
