"""Compute cost of one op: FLOPs and bytes moved (forward and backward), turned into seconds by a
roofline with named, calibratable efficiencies.

FLOPs of matmul, convolution and attention are counted by ``torch.utils.flop_counter`` on meta
tensors (forward, and backward through autograd: 2x forward for a matmul whose inputs both need
gradients). Other ops are memory-bound by rule: :data:`ELEMENT_FLOPS` per element forward,
:data:`BWD_RATIO` times that backward. Bytes are compulsory traffic: every tensor input read once,
every output written once (views move nothing; gathers read only the rows they return). An op
of autopar's own that runs as several ATen kernels (:data:`COMPOSITES`: the linear scan, the delta
rule's scan over chunks, RWKV's loop) costs what they do: its implementation runs once per shape on meta
tensors, its kernels counted and priced by the same rules; so does its backward where
:data:`COMPOSITE_BACKWARDS` has it (otherwise :data:`BWD_RATIO` times the forward's FLOPs and
bytes, as many kernels).

Time of one phase on a device (see :class:`~autopar.cost_models.devices.DeviceSpec`)::

    t = kernels * overhead(class) + max(F / (peak(dtype) * eff(class) * d / (d + half_dim)),
                                    B / (memory_bandwidth * eff(memory class)))

where ``d`` is the smallest GEMM dimension of a matmul-like op. Costing is cached by (op, shapes).
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import torch
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

from torch.utils._python_dispatch import TorchDispatchMode

from autopar.core.ir import OpSpec, TensorMeta, spec_of_call, spec_of_node
from autopar.core.placement import local_shape
from autopar.cost_models.devices import COMPUTE_CLASSES, DeviceSpec, dtype_name
from autopar.passes.capture.delta_rule import delta_scan_backward, delta_scan_forward
from autopar.passes.capture.scan import odd_even_scan
from autopar.passes.capture.wkv import wkv_backward, wkv_loop, wkv_unit
from autopar.passes.rules.conv import channel_dim, with_local_groups

# Backward of a memory-bound op reads the output gradient and what it saved, writes the input
# gradient: about twice the forward's work and traffic. Matmul backward is 2x forward too
# (dX = dY W^T and dW = X^T dY).
BWD_RATIO = 2.0

_VIEW = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze",
    "slice", "select", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow",
    "as_strided", "unflatten", "flatten", "view_as", "expand_as", "_assert_tensor_metadata",
    "lift_fresh_copy", "sym_size", "sym_numel", "sym_stride", "dropout",
}
_MATMUL = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "matmul", "linear", "einsum", "_scaled_mm",
           "mv", "addmv", "dot", "_grouped_mm", "grouped_mm_fallback", "grouped_mm_fallback_backward",
           "linalg_solve_triangular", "chunk_delta_scan"}
_CONV = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d",
         "conv_transpose2d", "conv_transpose3d"}
_ATTENTION = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_cudnn_attention"}
_SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax"}
_NORMALIZATION = {"layer_norm", "native_layer_norm",
                  "group_norm", "native_group_norm", "batch_norm", "native_batch_norm",
                  "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "rms_norm",
                  "_fused_rms_norm", "instance_norm", "cross_entropy_loss", "nll_loss", "nll_loss_forward",
                  "nll_loss_nd"}
_REDUCTION = {"sum", "mean", "max", "min", "amax", "amin", "var", "std", "var_mean", "argmax", "argmin",
              "cumsum", "prod", "norm", "linalg_vector_norm", "logsumexp", "any", "all", "mse_loss"}
_INDEXING = {"embedding", "index", "index_select", "gather", "take", "embedding_dense_backward"}
_COPY = {"clone", "contiguous", "_to_copy", "to", "copy", "copy_", "cat", "stack", "pad",
         "constant_pad_nd", "repeat", "flip", "roll", "index_put", "scatter", "scatter_add",
         "masked_fill", "where", "tril", "triu"}
_FACTORY = {"arange", "zeros", "ones", "full", "empty", "new_zeros", "new_ones", "new_full",
            "new_empty", "zeros_like", "ones_like", "full_like", "empty_like", "rand", "randn",
            "rand_like", "randn_like", "scalar_tensor", "empty_strided", "scalar_tensor"}

# FLOPs per element (of the output for elementwise ops, of the input for normalisations and
# reductions) for memory-bound ops; everything else counts 1. Rough, like fvcore's and DeepSpeed's
# flop profilers: they only matter on devices where these ops are compute-bound.
ELEMENT_FLOPS = {
    "gelu": 8, "silu": 4, "sigmoid": 4, "tanh": 4, "exp": 2, "log": 2, "pow": 2, "rsqrt": 2, "erf": 4,
    "native_dropout": 2, "softmax": 5, "_softmax": 5, "log_softmax": 5, "_log_softmax": 5,
    "layer_norm": 8, "native_layer_norm": 8, "group_norm": 8, "native_group_norm": 8,
    "batch_norm": 8, "native_batch_norm": 8, "_native_batch_norm_legit": 8,
    "_native_batch_norm_legit_no_training": 4, "rms_norm": 5, "_fused_rms_norm": 5,
    "cross_entropy_loss": 6,
}


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """A grouped matmul's FLOPs from its operands' shapes: every group's rows x inner x columns,
    summed, whichever dim the offsets split (2D x 3D: the rows; 2D x 2D: the inner dim, giving
    one (inner, out) weight gradient per group; 3D x 2D: the columns; 3D x 3D: none)."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 2:
        return 2 * a[1] * a[2] * b[1]
    return 2 * a[0] * a[1] * a[2] * b[2]


def _grouped_mm_backward_flops(x, weight, offs, grad, *args, out_shape=None, **kwargs) -> int:
    """transformers' grouped matmul backward: the input's and the weight's gradient GEMMs."""
    return 2 * _grouped_mm_flops(x, weight)


def _solve_triangular_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """Triangular systems by substitution: each right-hand side takes ``n^2`` multiply-adds over
    an ``n x n`` system, so ``n`` times the solution's size (batched or broadcast alike)."""
    return a[-1] * math.prod(out_shape)


def _convolution_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,
                                _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:
    """A convolution's backward: the input's gradient as torch counts it, the weight's as many
    FLOPs as the forward. (torch's formula counts the weight's gradient of a grouped convolution as
    if it were dense, ``groups`` times too many: a depthwise conv's backward 13x its forward.)"""
    count = 0
    if output_mask[0]:
        count += conv_flop_count(grad_out_shape, w_shape, list(out_shape[0]), not transposed)
    if output_mask[1]:
        count += conv_flop_count(x_shape, w_shape, grad_out_shape, transposed)
    return count


def flop_formulas() -> dict:
    """FlopCounterMode formulas (``custom_mapping``) that planning and ``verify`` count with:
    grouped matmuls and triangular solves, which torch's counter leaves out (``aten._grouped_mm`` and, once
    ``transformers.integrations.moe`` has registered it, ``transformers::grouped_mm_fallback``
    and its backward), and a grouped convolution's backward, which it over-counts."""
    table = {torch.ops.aten._grouped_mm: _grouped_mm_flops,
             torch.ops.aten.convolution_backward: _convolution_backward_flops,
             torch.ops.aten.linalg_solve_triangular: _solve_triangular_flops}
    ops = torch.ops.transformers
    if hasattr(ops, "grouped_mm_fallback"):
        table[ops.grouped_mm_fallback] = _grouped_mm_flops
    if hasattr(ops, "grouped_mm_fallback_backward"):
        table[ops.grouped_mm_fallback_backward] = _grouped_mm_backward_flops
    return table


def op_name(op) -> str:
    """``aten.mm.default`` -> ``"mm"``; other callables by ``__name__``."""
    packet = getattr(op, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(op, "__name__", str(op))


@lru_cache(maxsize=None)
def op_class(op) -> str:
    """The op family the roofline treats alike: ``"view"``, ``"matmul"``, ``"conv"``,
    ``"attention"``, ``"softmax"``, ``"normalization"``, ``"reduction"``, ``"indexing"``, ``"copy"``,
    ``"factory"`` or ``"elementwise"``."""
    name = op_name(op)
    if not isinstance(op, torch._ops.OpOverload) or name in _VIEW:
        return "view"
    for cls, names in (("matmul", _MATMUL), ("conv", _CONV), ("attention", _ATTENTION),
                       ("softmax", _SOFTMAX), ("normalization", _NORMALIZATION), ("reduction", _REDUCTION),
                       ("indexing", _INDEXING), ("copy", _COPY), ("factory", _FACTORY)):
        if name in names:
            return cls
    return "elementwise"


def _freeze(x):
    if isinstance(x, (list, tuple)):
        return tuple(_freeze(v) for v in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in x.items()))
    try:
        hash(x)
    except TypeError:
        return repr(x)
    return x


def spec_key(spec: OpSpec):
    """A hashable key of an OpSpec (op, tensor shapes and dtypes, other arguments)."""
    return (spec.op, _freeze(spec.args), _freeze(spec.kwargs), spec.outputs)


def _numel(meta: TensorMeta) -> int:
    return math.prod(meta.shape)


def _nbytes(meta: TensorMeta, dtype=None) -> int:
    item = dtype.itemsize if dtype is not None and meta.dtype.is_floating_point else meta.dtype.itemsize
    return _numel(meta) * item


def _differentiable(spec: OpSpec) -> bool:
    return (any(t.dtype.is_floating_point for t in spec.inputs)
            and any(t.dtype.is_floating_point for t in spec.outputs))


def gemm_dims(spec: OpSpec) -> tuple[int, int, int, int] | None:
    """``(batch, m, n, k)`` of the GEMM a matmul, convolution or attention op performs (for
    attention the larger of its two GEMMs, QK^T), or None for other ops."""
    name, ins = op_name(spec.op), spec.inputs
    try:
        if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "_scaled_mm"):
            a, b = (ins[1], ins[2]) if name in ("addmm", "baddbmm") else (ins[0], ins[1])
            m = a.shape[-2] if a.ndim > 1 else 1
            n = b.shape[-1] if b.ndim > 1 else 1
            batch = math.prod(spec.outputs[0].shape) // (m * n) if spec.outputs else 1
            return batch, m, n, a.shape[-1]
        if name == "chunk_delta_scan":  # per chunk (chunk x key dim) @ (key dim x value dim) and alike
            values, key = ins[2], ins[1]
            return math.prod(values.shape[:3]), values.shape[3], values.shape[4], key.shape[4]
        if name == "linalg_solve_triangular":  # n x n systems times k right-hand sides
            a, out = ins[0], spec.outputs[0]
            return math.prod(out.shape[:-2]), out.shape[-2], out.shape[-1], a.shape[-1]
        if name == "linear":
            x, w = ins[0], ins[1]
            return 1, _numel(x) // x.shape[-1], w.shape[0], w.shape[-1]
        if op_class(spec.op) == "conv":
            w, out = ins[1], spec.outputs[0]
            c_out = out.shape[1]
            return 1, _numel(out) // c_out, c_out, _numel(w) // w.shape[0]
        if op_class(spec.op) == "attention":
            q, k = ins[0], ins[1]
            return math.prod(q.shape[:-2]), q.shape[-2], k.shape[-2], q.shape[-1]
    except (IndexError, ZeroDivisionError):
        return None
    return None


def _meta_tensor(t: TensorMeta, grad: bool):
    x = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return x.requires_grad_(True) if grad and t.dtype.is_floating_point else x


def _counted_flops(spec: OpSpec, grads: tuple[bool, ...] | None) -> tuple[int, int]:
    """Run ``spec`` on meta tensors under FlopCounterMode, forward then backward (``grads``: see
    :func:`node_flops`)."""
    needs = iter(grads if grads is not None else [True] * len(spec.inputs))
    args, kwargs = pytree.tree_map(
        lambda x: _meta_tensor(x, next(needs)) if isinstance(x, TensorMeta) else x, (spec.args, spec.kwargs))
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.requires_grad]
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        out = spec.op(*args, **kwargs)
    fwd = counter.get_total_flops()
    outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not outs or not leaves:
        return fwd, 0
    with FlopCounterMode(display=False, custom_mapping=flop_formulas()) as counter:
        torch.autograd.grad(outs, leaves, grad_outputs=[torch.empty_like(o) for o in outs],
                            allow_unused=True)
    return fwd, counter.get_total_flops()


_FLOPS_CACHE: dict = {}
_TIME_CACHE: dict = {}
_STRATEGY_CACHE: dict = {}
_COMPOSITE_CACHE: dict = {}


def _attention_flops(spec: OpSpec, grads: tuple[bool, ...] | None) -> tuple[int, int]:
    """Attention as torch's FlopCounterMode counts the fused kernels a program runs (on a meta
    tensor the op decomposes into plain GEMMs instead): a backward that recomputes the scores."""
    q, k, v = (tuple(t.shape) for t in spec.inputs[:3])
    fwd = sdpa_flop_count(q, k, v)
    if grads is not None and not any(grads[:3]):
        return fwd, 0
    return fwd, sdpa_backward_flop_count(tuple(spec.outputs[0].shape), q, k, v)


def _unfused(spec: OpSpec, grads: tuple[bool, ...] | None) -> bool:
    """Whether ``scaled_dot_product_attention`` runs as plain GEMMs, not a fused kernel: torch does
    so for a mask that needs a gradient (Doge's learned one) or with dropout (checked on CPU,
    where verify and the saved-tensors pass run programs)."""
    if op_name(spec.op) != "scaled_dot_product_attention":
        return False
    mask_grad = grads is not None and len(spec.inputs) > 3 and len(grads) > 3 and grads[3]
    return bool(mask_grad or spec.arg(4, "dropout_p", 0.0))


def _delta_scan_backward(*inputs):
    return delta_scan_backward(inputs, torch.empty_like(inputs[2]), torch.empty_like(inputs[6]))


def _wkv_backward(*inputs):
    return wkv_backward(inputs, torch.empty_like(inputs[2]))


# autopar's own ops that run as several ATen kernels: op name -> the function their kernel runs
COMPOSITES = {"linear_scan": odd_even_scan, "chunk_delta_scan": delta_scan_forward, "wkv": wkv_loop}
COMPOSITE_BACKWARDS = {"chunk_delta_scan": _delta_scan_backward, "wkv": _wkv_backward}  # op name -> its backward
# composites whose counts are linear in the sizes of some dims: op name -> (its arguments -> the
# (arguments, weight, kernels' weight) of small pieces whose weighted counts sum to the op's)
COMPOSITE_UNITS = {"wkv": wkv_unit}


class _Kernels(TorchDispatchMode):
    """Counts the kernels a composite runs: FLOPs, element reads and writes, kernel launches."""

    def __init__(self):
        super().__init__()
        self.flops = self.elements = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if op_class(func) != "view":
            spec = spec_of_call(func, args, kwargs or {}, out)
            self.flops += node_flops(spec)[0]
            reads = spec.inputs if op_class(func) != "factory" else []
            self.elements += sum(_numel(t) for t in [*spec.outputs, *reads])
            self.kernels += 1
        return out


def _composite(spec: OpSpec, backward: bool = False) -> tuple[int, int, int]:
    """(FLOPs, elements read and written, kernels) of a composite op's forward, or of its
    backward (:data:`COMPOSITE_BACKWARDS`; else :data:`BWD_RATIO` times the forward's, as many
    kernels)."""
    name = op_name(spec.op)
    if backward and name not in COMPOSITE_BACKWARDS:
        flops, elements, kernels = _composite(spec)
        return int(BWD_RATIO * flops), int(BWD_RATIO * elements), kernels
    if name in COMPOSITE_UNITS:  # counted on small pieces, combined
        counts = [(_counted(spec.op, args, spec.kwargs, backward), weight, kernel_weight)
                  for args, weight, kernel_weight in COMPOSITE_UNITS[name](spec.args)]
        return tuple(sum(c[k] * (w if k < 2 else kw) for c, w, kw in counts) for k in range(3))
    return _counted(spec.op, spec.args, spec.kwargs, backward)


def _counted(op, args, kwargs, backward: bool) -> tuple[int, int, int]:
    """What :func:`_composite` says of ``op`` called on ``args`` (shaped objects), counted by
    running its function on meta tensors (cached)."""
    key = op, _freeze(args), _freeze(kwargs), backward
    if key not in _COMPOSITE_CACHE:
        args, kwargs = _map_meta((args, kwargs), lambda m: torch.empty(m.shape, dtype=m.dtype, device="meta"))
        with _Kernels() as count:
            (COMPOSITE_BACKWARDS if backward else COMPOSITES)[op_name(op)](*args, **kwargs)
        _COMPOSITE_CACHE[key] = count.flops, count.elements, count.kernels
    return _COMPOSITE_CACHE[key]


def _is_composite(spec: OpSpec) -> bool:
    return op_name(spec.op) in COMPOSITES and getattr(spec.op, "namespace", None) == "autopar"


def _flops_uncached(spec: OpSpec, grads: tuple[bool, ...] | None, executed: bool) -> tuple[int, int]:
    cls = op_class(spec.op)
    if _is_composite(spec):
        return _composite(spec)[0], _composite(spec, backward=True)[0] if _differentiable(spec) else 0
    if cls in COMPUTE_CLASSES:
        try:
            if executed and cls == "attention" and not _unfused(spec, grads):
                return _attention_flops(spec, grads)
            return _counted_flops(spec, grads)
        except Exception as exc:  # an op the meta kernels cannot run: count its GEMM by rule
            dims = gemm_dims(spec)
            if dims is None:
                warnings.warn(f"cannot count FLOPs of {spec.op} ({exc}); costing it as free", stacklevel=3)
                return 0, 0
            fwd = 2 * math.prod(dims) * (2 if cls == "attention" else 1)
            return fwd, int(BWD_RATIO * fwd) if grads is None or any(grads) else 0
    if cls in ("view", "factory", "copy", "indexing"):
        return 0, 0
    per = ELEMENT_FLOPS.get(op_name(spec.op), 1)
    sized = spec.inputs if cls in ("softmax", "normalization", "reduction") and spec.inputs else spec.outputs
    fwd = per * max((_numel(t) for t in sized), default=0)
    return fwd, int(BWD_RATIO * fwd) if _differentiable(spec) else 0


def node_flops(spec: OpSpec, grads: tuple[bool, ...] | None = None, *, executed: bool = False) -> tuple[int, int]:
    """``(forward FLOPs, backward FLOPs)`` of one op call: the model's (attention's backward as
    four GEMMs, as Megatron counts it), or with ``executed`` those the program runs (a fused
    attention kernel recomputes the scores in backward). ``grads``: whether each tensor input
    (in :attr:`OpSpec.inputs` order) needs a gradient; None assumes every floating one does
    (a first layer's raw input needs none: its matmul then skips the input-gradient GEMM)."""
    key = (spec_key(spec), grads, executed)
    if key not in _FLOPS_CACHE:
        fwd, bwd = _flops_uncached(spec, grads, executed)
        _FLOPS_CACHE[key] = (fwd, 0) if grads is not None and not any(grads) else (fwd, bwd)  # no backward runs
    return _FLOPS_CACHE[key]


def node_bytes(spec: OpSpec, *, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """``(forward bytes, backward bytes)`` moved to and from device memory; ``dtype`` overrides
    the itemsize of floating tensors (mixed precision)."""
    cls = op_class(spec.op)
    if cls == "view":
        return 0, 0
    outs = sum(_nbytes(t, dtype) for t in spec.outputs)
    if cls == "factory":
        return outs, 0
    if _is_composite(spec):
        item = dtype.itemsize if dtype is not None else spec.outputs[0].dtype.itemsize
        bwd = _composite(spec, backward=True)[1] * item if _differentiable(spec) else 0
        return _composite(spec)[1] * item, bwd
    if cls == "indexing":  # read the gathered rows and the indices, write the result
        idx = sum(_nbytes(t, dtype) for t in spec.inputs if not t.dtype.is_floating_point)
        fwd = 2 * outs + idx
    else:
        fwd = sum(_nbytes(t, dtype) for t in spec.inputs) + outs
    return fwd, int(BWD_RATIO * fwd) if _differentiable(spec) else 0


def _map_meta(x, fn):
    """Apply ``fn`` to every TensorMeta in nested tuples/lists/dicts, in pytree order."""
    if isinstance(x, TensorMeta):
        return fn(x)
    if isinstance(x, (tuple, list)):
        return type(x)(_map_meta(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_meta(v, fn) for k, v in x.items()}
    return x


def localize(spec: OpSpec, strategy, mesh_shape) -> OpSpec:
    """``spec`` with every tensor replaced by its local piece under ``strategy`` (a
    :class:`~autopar.passes.rules.registry.Strategy`) and the arguments its local implementation
    changes; raises ShardingError on uneven splits."""
    if strategy is None:
        return spec
    it = iter(strategy.inputs)
    args, kwargs = _map_meta((spec.args, spec.kwargs),
                             lambda x: TensorMeta(local_shape(x.shape, next(it), mesh_shape), x.dtype))
    outs = tuple(TensorMeta(local_shape(t.shape, s, mesh_shape), t.dtype)
                 for t, s in zip(spec.outputs, strategy.outputs))
    if strategy.local == "groups":  # a grouped conv split by whole groups runs with fewer groups
        c = channel_dim(spec.args[0], spec.args[1])
        args, kwargs = with_local_groups(spec.op, args, kwargs, args[0].shape[c], spec.args[0].shape[c])
    return OpSpec(spec.op, tuple(args), kwargs, outs)


def _compute_dtype(spec: OpSpec, dtype):
    if dtype is not None:
        return dtype
    for t in list(spec.inputs) + list(spec.outputs):
        if t.dtype.is_floating_point:
            return t.dtype
    return torch.float32


def roofline_time(*, flops: float, nbytes: float, op_cls: str, dtype, device: DeviceSpec,
                  min_dim: float | None = None, kernels: int = 1) -> float:
    """Seconds for ``flops`` and ``nbytes`` of an op of class ``op_cls`` (module docstring)."""
    if op_cls == "view" or (flops <= 0 and nbytes <= 0):
        return 0.0
    if op_cls in COMPUTE_CLASSES:
        rate = device.peak(dtype) * device.class_efficiency(op_cls)
        if min_dim is not None and device.matmul_half_dim > 0:
            rate *= min_dim / (min_dim + device.matmul_half_dim)
        bandwidth = device.memory_bandwidth * device.class_efficiency("copy")
    else:
        rate = device.vector_flops
        bandwidth = device.memory_bandwidth * device.class_efficiency(
            "copy" if op_cls == "factory" else op_cls)
    return kernels * device.kernel_overhead(op_cls) + max(flops / rate, nbytes / bandwidth)


def _time_uncached(spec: OpSpec, device: DeviceSpec, dtype, grads: tuple[bool, ...] | None) -> tuple[float, float]:
    cls = op_class(spec.op)
    if cls == "view":
        return 0.0, 0.0
    f_fwd, f_bwd = node_flops(spec)
    b_fwd, b_bwd = node_bytes(spec, dtype=dtype)
    if grads is not None and f_bwd:  # only the gradients its inputs need (none: no backward runs)
        needed = node_flops(spec, grads)[1]
        f_bwd, b_bwd = needed, b_bwd * needed / f_bwd
    elif grads is not None and not any(grads):
        b_bwd = 0
    cdtype = dtype_name(_compute_dtype(spec, dtype))
    dims = gemm_dims(spec) if cls in COMPUTE_CLASSES else None
    min_dim = min(dims[1:]) if dims else None
    composite = _is_composite(spec)
    kernels = _composite(spec)[2] if composite else 1
    fwd = roofline_time(flops=f_fwd, nbytes=b_fwd, op_cls=cls, dtype=cdtype, device=device, min_dim=min_dim,
                        kernels=kernels)
    bwd = 0.0
    if f_bwd > 0 or b_bwd > 0:
        if composite:
            kernels = _composite(spec, backward=True)[2]
        elif cls in COMPUTE_CLASSES:
            kernels = 2
        bwd = roofline_time(flops=f_bwd, nbytes=b_bwd, op_cls=cls, dtype=cdtype, device=device,
                            min_dim=min_dim, kernels=kernels)
    return fwd, bwd


def compute_time(spec: OpSpec, strategy, mesh_shape, device_spec: DeviceSpec, *,
                 dtype: torch.dtype | None = None, grads: tuple[bool, ...] | None = None) -> tuple[float, float]:
    """``(forward seconds, backward seconds)`` of ``spec`` on one device under ``strategy``.

    Costs the *local* shapes (:func:`localize`); ``strategy=None`` costs the whole op.
    ``dtype`` is the compute dtype under mixed precision (e.g. ``torch.bfloat16`` for a model
    captured in fp32); by default the op's own floating dtype. ``grads``: whether each tensor
    input gets a gradient from the op's backward (:func:`node_flops`); none: no backward runs,
    and a frozen weight's gradient GEMM is left out. None: every floating input gets one.
    """
    mesh_shape = tuple(mesh_shape)
    outer = (spec_key(spec), strategy, mesh_shape, device_spec, dtype, grads)
    hit = _STRATEGY_CACHE.get(outer)
    if hit is None:
        local = localize(spec, strategy, mesh_shape)
        key = (spec_key(local), device_spec, dtype, grads)
        if key not in _TIME_CACHE:
            _TIME_CACHE[key] = _time_uncached(local, device_spec, dtype, grads)
        hit = _STRATEGY_CACHE[outer] = _TIME_CACHE[key]
    return hit


def clear_caches() -> None:
    """Forget cached FLOP counts and times (they are keyed by op, shapes and device)."""
    _FLOPS_CACHE.clear()
    _COMPOSITE_CACHE.clear()
    _TIME_CACHE.clear()
    _STRATEGY_CACHE.clear()


def graph_flops(graph_module: torch.fx.GraphModule) -> tuple[int, int]:
    """``(forward, backward)`` FLOPs summed over every ATen op of a captured graph (nodes carry
    ``meta["val"]``)."""
    fwd = bwd = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            if op_class(node.target) in ("view", "factory"):
                continue
            f, b = node_flops(spec_of_node(node))
            fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


__all__ = [
    "BWD_RATIO",
    "clear_caches",
    "ELEMENT_FLOPS",
    "compute_time",
    "gemm_dims",
    "graph_flops",
    "localize",
    "node_bytes",
    "node_flops",
    "op_class",
    "roofline_time",
    "spec_key",
]
