"""What the layout walk (:mod:`qsync_opt.hfta.layout_walk`) and the translation rules
(:mod:`qsync_opt.hfta.translation`) know of each module and op of a standalone model: the
modules with a fused operator and the layout it takes, the stateless modules every model
shares, the functions by the name the tables go by (methods go by their own name), and the
classes of ops: per element (broadcast), like their first operand, fresh tensors, random
draws, the dim arguments of shape ops.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from qsync_opt.hfta.conv_ops import FusedBatchNorm2d, FusedConv2d
from qsync_opt.hfta.linear_ops import FusedEmbedding, FusedLayerNorm, FusedLinear

#: A fused operator with parameters (each has ``from_modules`` and ``export``).
FusedOp = FusedConv2d | FusedBatchNorm2d | FusedLinear | FusedLayerNorm | FusedEmbedding

#: Modules that hold no parameters and act per element or per channel: shared by all B.
STATELESS_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.LeakyReLU,
                     nn.Dropout, nn.Identity, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d,
                     nn.Hardswish, nn.Hardsigmoid)
SPATIAL_MODULES = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d)
SPATIAL_FUNCTIONS = {"adaptive_avg_pool2d", "max_pool2d", "avg_pool2d"}
FUSED_CLASSES: dict[type[nn.Module], type[FusedOp]] = {
    nn.Conv2d: FusedConv2d, nn.BatchNorm2d: FusedBatchNorm2d, nn.Linear: FusedLinear,
    nn.LayerNorm: FusedLayerNorm, nn.Embedding: FusedEmbedding}
#: The layout each fused op takes (and gives); the Embedding takes ids M or S, gives M.
FUSED_LAYOUT: dict[type[FusedOp], str] = {
    FusedConv2d: "C", FusedBatchNorm2d: "C", FusedLinear: "M", FusedLayerNorm: "M",
    FusedEmbedding: "M"}

#: Functions the walk knows, by the name the translation tables below use (methods go by
#: their own name).
FUNCTION_NAMES: dict[Callable[..., object], str] = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floordiv", operator.pow: "pow", operator.neg: "neg",
    operator.iadd: "add_", operator.isub: "sub_", operator.imul: "mul_",
    operator.itruediv: "div_", operator.matmul: "matmul", operator.getitem: "getitem",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le",
    operator.gt: "gt", operator.ge: "ge", operator.and_: "logical_and",
    operator.or_: "logical_or", operator.invert: "logical_not",
    getattr: "getattr",
    torch.add: "add", torch.sub: "sub", torch.mul: "mul", torch.div: "div",
    torch.pow: "pow", torch.neg: "neg", torch.exp: "exp", torch.log: "log",
    torch.sqrt: "sqrt", torch.rsqrt: "rsqrt", torch.abs: "abs", torch.tanh: "tanh",
    torch.sigmoid: "sigmoid", torch.relu: "relu", torch.erf: "erf", torch.where: "where",
    torch.maximum: "maximum", torch.minimum: "minimum", torch.clamp: "clamp",
    torch.masked_fill: "masked_fill", torch.logical_not: "logical_not",
    torch.logical_and: "logical_and", torch.logical_or: "logical_or", torch.eq: "eq",
    torch.ne: "ne", torch.lt: "lt", torch.le: "le", torch.gt: "gt", torch.ge: "ge",
    F.relu: "relu", F.gelu: "gelu", F.silu: "silu", F.sigmoid: "sigmoid", F.tanh: "tanh",
    F.leaky_relu: "leaky_relu", F.softplus: "softplus", F.hardswish: "hardswish",
    F.hardsigmoid: "hardsigmoid", F.relu6: "relu6", F.elu: "elu", F.mish: "mish",
    F.dropout: "dropout", torch.dropout: "dropout",
    F.scaled_dot_product_attention: "scaled_dot_product_attention",
    torch.softmax: "softmax", F.softmax: "softmax", torch.log_softmax: "log_softmax",
    F.log_softmax: "log_softmax", torch.transpose: "transpose", torch.swapaxes: "swapaxes",
    torch.swapdims: "swapdims", torch.permute: "permute", torch.flatten: "flatten",
    torch.unflatten: "unflatten", torch.narrow: "narrow", torch.select: "select",
    torch.split: "split", torch.chunk: "chunk", torch.unbind: "unbind",
    torch.squeeze: "squeeze", torch.unsqueeze: "unsqueeze", torch.cumsum: "cumsum",
    torch.movedim: "movedim", torch.sum: "sum", torch.mean: "mean", torch.cat: "cat",
    torch.concat: "cat", torch.stack: "stack", torch.reshape: "reshape",
    torch.matmul: "matmul", torch.bmm: "matmul",
    torch.zeros_like: "zeros_like", torch.ones_like: "ones_like",
    torch.full_like: "full_like", torch.empty_like: "empty_like",
    torch.rand_like: "rand_like", torch.randn_like: "randn_like",
    torch.rand: "rand", torch.randn: "randn", torch.randint: "randint",
    torch.randperm: "randperm", torch.normal: "normal", torch.bernoulli: "bernoulli",
    torch.multinomial: "multinomial",
    F.adaptive_avg_pool2d: "adaptive_avg_pool2d", F.max_pool2d: "max_pool2d",
    F.avg_pool2d: "avg_pool2d",
}
#: Ops that act per element (or broadcast their operands' leading dims, as attention does).
BROADCAST_OPS = {"add", "sub", "mul", "div", "truediv", "floordiv", "pow", "neg", "add_", "sub_",
                 "mul_", "div_", "exp", "log", "sqrt", "rsqrt", "abs", "tanh", "sigmoid", "relu",
                 "relu_", "erf", "where", "maximum", "minimum", "clamp", "clamp_", "masked_fill",
                 "masked_fill_", "logical_not", "logical_and", "logical_or", "eq", "ne", "lt",
                 "le", "gt", "ge", "gelu", "silu", "leaky_relu", "softplus", "hardswish",
                 "hardsigmoid", "relu6", "elu", "mish", "dropout", "reciprocal", "square",
                 "sin", "cos", "scaled_dot_product_attention"}
#: Of those, the ops whose result has the first operand's shape (a shared first operand is
#: broadcast to the models first).
SELF_SHAPED_OPS = {"masked_fill", "masked_fill_", "add_", "sub_", "mul_", "div_", "clamp_",
                   "relu_"}
#: Ops whose result has the layout of their first operand (dtype, device, copies, likes).
LIKE_OPS = {"contiguous", "float", "double", "half", "bfloat16", "to", "type_as", "type",
            "clone", "detach", "cpu", "cuda", "requires_grad_", "zeros_like", "ones_like",
            "full_like", "empty_like", "rand_like", "randn_like"}
#: Methods that make a new tensor of a given size (no model axis: shared).
FRESH_OPS = {"new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"}
#: Ops that draw random numbers: on a shared value every model would draw the same.
RANDOM_OPS = {"rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial",
              "rand_like", "randn_like", "bernoulli_", "normal_", "uniform_", "random_",
              "exponential_", "dropout"}
#: The attributes of a tensor the walk reads (``shape`` and ``ndim`` per model).
TENSOR_ATTRS = {"shape", "ndim", "dtype", "device", "is_cuda", "requires_grad", "layout"}

REQUIRED, EVERY_DIM = "required", "every"
#: The dim arguments of shape ops: op -> ((position in the call's arguments, the tensor
#: first; keyword; default), ...). A default int is shifted as given ones are; REQUIRED: the
#: call must give it; EVERY_DIM: absent means every dim (each op's own reading of that).
DIM_ARGS: dict[str, tuple[tuple[int, str, int | str], ...]] = {
    "softmax": ((1, "dim", REQUIRED),), "log_softmax": ((1, "dim", REQUIRED),),
    "narrow": ((1, "dim", REQUIRED),), "unflatten": ((1, "dim", REQUIRED),),
    "select": ((1, "dim", REQUIRED),), "cumsum": ((1, "dim", REQUIRED),),
    "unsqueeze": ((1, "dim", REQUIRED),),
    "transpose": ((1, "dim0", REQUIRED), (2, "dim1", REQUIRED)),
    "swapaxes": ((1, "axis0", REQUIRED), (2, "axis1", REQUIRED)),
    "swapdims": ((1, "dim0", REQUIRED), (2, "dim1", REQUIRED)),
    "movedim": ((1, "source", REQUIRED), (2, "destination", REQUIRED)),
    "flatten": ((1, "start_dim", 0), (2, "end_dim", -1)),
    "split": ((2, "dim", 0),), "chunk": ((2, "dim", 0),), "unbind": ((1, "dim", 0),),
    "squeeze": ((1, "dim", EVERY_DIM),), "sum": ((1, "dim", EVERY_DIM),),
    "mean": ((1, "dim", EVERY_DIM),), "size": ((1, "dim", EVERY_DIM),),
    "cat": ((1, "dim", 0),), "stack": ((1, "dim", 0),),
}
#: Ops that give a tuple of model-major values.
SEQUENCE_OPS = {"split", "chunk", "unbind"}
