"""Memory rules: what each operator holds, with PyTorch eager semantics.

A rule is a small pure function registered with ``@rule("op")``. It receives the
node, its input tensors (:class:`TensorInfo`: symbolic shape, dtype, contiguity,
whether it requires grad) and a :class:`Ctx` (autocast on or off, CUDA or CPU),
and returns a :class:`Footprint`:

- ``out``: the output tensor; ``alias`` = i when the output is a view of input i
  (it shares that storage and allocates nothing);
- ``saved``: the tensors autograd saves for backward, each either a reference to
  an input's or the output's storage (``"in0"``, ``"out"``: no new memory) or a
  new storage (``"new"``), or an autocast copy of a parameter (``"cast:NAME"``,
  one per parameter however often it is used: autocast caches it);
- ``fwd_temp``: bytes that exist only while the op runs;
- ``grads``: per input, what backward allocates for its gradient: ``"new"`` (a
  tensor of the input's size and dtype), ``"pass"`` (the output's gradient is
  handed on, no allocation), ``"slice"`` (a share of one gradient of the whole
  input, allocated by the first slice to arrive) or ``None`` (no gradient);
- ``bwd_temp``: bytes that exist only while the op's backward runs (for example
  the half-precision gradient of an autocast copy before it is cast back).

Parameter gradients are added by lowering (symmem.lowering): a parameter's gradient is
allocated the first time backward reaches a node that uses it.

Layout (module -> rules):

- ``core``: the vocabulary (:class:`DType`, :class:`TensorInfo`, :class:`Saved`,
  :class:`Footprint`, :class:`Ctx`) and the registry (:func:`rule`, :func:`get_rule`,
  ``RULES``, :func:`infer_shape`);
- ``autocast``: what ``torch.autocast`` does to each aten op, one table per device,
  from PyTorch's ``autocast_mode.cpp`` / ``autocast_mode.h``; rules ask
  :meth:`Ctx.autocast_dtype` instead of branching on the device;
- ``views``: input, carry, split, heads, repeat_kv, merge_heads;
- ``elementwise``: add, mul, scale, dropout, gelu, gelu_new, relu, silu, clone, type_as, to_compute,
  to_param_dtype, to_float32;
- ``normalization``: layer_norm, rms_norm, softmax, log_softmax;
- ``linalg``: linear, matmul;
- ``quantized``: linear_int4, linear_int8 (bitsandbytes' layers with frozen quantized weights);
- ``fp8``: linear_fp8 (Transformer Engine's FP8 linear layer, CUDA);
- ``attention``: attention (the node a model writes; the attention pass replaces it),
  sdpa_kernel (flash, mem-efficient, cuDNN), sdpa_causal_mask;
- ``cache``: kv_cache (a layer's keys or values appended to the KV cache, inference),
  static_sdpa_mask, sdpa_float_mask, static_seq_length (a StaticCache's decoding step),
  kv_fp8_scale, kv_fp8_quantize, kv_fp8_dequantize (an fp8 QuantizedCache), kv_one_head (one kv
  head's states a quantized cache's prefill returns);
- ``quanto``: kv_quanto_quantize, kv_quanto_kept, kv_quanto_dequantize, kv_quanto_cat (a quanto
  QuantizedCache, optimum-quanto's int4 and int2 layout);
- ``embeddings``: embedding, positions, position_embedding, ones_like_ids, cumsum_positions,
  offset_ids (OPT's positions), rotary, rope, causal_mask;
- ``losses``: nll_loss;
- ``masks``: window_mask, mask_expand, sdpa_bool_mask (a sliding window's boolean mask for SDPA, and SDPA's
  float copy of it);
- ``moe``: reshape, topk_indices, topk, sum_last, div_inplace, index_tensor, gather_rows,
  grouped_mm, sum_topk (a mixture of experts' router and dispatch);
- ``encoders``: buffer_slice, padding_mask, cross_entropy_cast (BERT);
- ``vision``: conv2d, batch_norm, relu_ (in place), max_pool2d, mean_pool, flatten, ce_input,
  ce_log_softmax (convolutional networks and ``F.cross_entropy``), patch_tokens, cls_concat,
  add_param, select_token (the vision transformer's embeddings and head);
- ``relative``: T5's relative position bias (position_pair, relative_position, position_bucket,
  bias_heads, zeros_bias, bias_mask), shift_right, autocast_copy, t5_layer_norm, fp16_clamp.

A new op is a function in the module of its kind (or a new kind module imported
below). The rules were read off PyTorch's autograd formulas (``derivatives.yaml``)
and checked against saved-tensor hooks on the CPU (``tests/test_rules.py``).
Where CPU and CUDA differ the rule says so in its docstring.
"""
from __future__ import annotations

from .autocast import AUTOCAST, CAST_POLICIES, autocast_policy
from .core import (BOOL, F32, F64, I64, RULES, Ctx, DType, Footprint, NodeLike, Rule, Saved,
                   TensorInfo, get_rule, infer_shape, rule)
# the kind modules register their rules on import
from .attention import attention_rule, sdpa_causal_mask_rule, sdpa_kernel_rule
from .cache import (fp8_dequantize_rule, fp8_quantize_rule, fp8_scale_rule, kv_cache_rule, kv_one_head_rule,
                    sdpa_float_mask_rule, static_sdpa_mask_rule, static_seq_length_rule)
from .generation import last_position_rule
from .elementwise import (add_rule, clone_rule, dropout_rule, gelu_new_rule, gelu_rule, mul_rule, relu_rule,
                          scale_rule, silu_rule, to_compute_rule, to_float32_rule, to_param_dtype_rule,
                          type_as_rule)
from .encoders import buffer_slice_rule, cross_entropy_cast_rule, padding_mask_rule
from .embeddings import (causal_mask_rule, cumsum_positions_rule, embedding_rule, offset_ids_rule,
                         ones_like_ids_rule, position_embedding_rule, positions_rule, rope_rule, rotary_rule)
from .fp8 import linear_fp8_rule
from .quanto import quanto_cat_rule, quanto_dequantize_rule, quanto_kept_rule, quanto_quantize_rule
from .linalg import linear_rule, matmul_rule
from .losses import nll_loss_rule
from .masks import mask_expand_rule, sdpa_bias_expand_rule, sdpa_bool_mask_rule, window_mask_rule  # noqa: F401
from .moe import (div_inplace_rule, gather_rows_rule, grouped_mm_rule, index_tensor_rule, reshape_rule,
                  sum_last_rule, sum_topk_rule, topk_indices_rule, topk_rule)
from .normalization import layer_norm_rule, log_softmax_rule, rms_norm_rule, softmax_rule
from .quantized import linear_int4_rule, linear_int8_rule
from .relative import (autocast_copy_rule, bias_heads_rule, bias_mask_rule, fp16_clamp_rule,  # noqa: F401
                       position_bucket_rule, position_pair_rule, relative_position_rule, shift_right_rule,
                       t5_layer_norm_rule, zeros_bias_rule)
from .views import carry_rule, heads_rule, input_rule, merge_heads_rule, repeat_kv_rule, split_rule
from .vision import (add_param_rule, batch_norm_rule, ce_input_rule, ce_log_softmax_rule, cls_concat_rule,
                     conv2d_rule, flatten_rule, max_pool2d_rule, mean_pool_rule, patch_tokens_rule,
                     relu_inplace_rule, select_token_rule)

__all__ = ["DType", "TensorInfo", "Saved", "Footprint", "Ctx", "NodeLike", "Rule", "rule",
           "get_rule", "RULES", "infer_shape", "F32", "F64", "I64", "BOOL", "AUTOCAST",
           "CAST_POLICIES", "autocast_policy"]
